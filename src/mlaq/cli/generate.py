"""``mlaq generate [MODEL] --prompt ...`` — complete prompts with mlaq's engine; with
``--speculative-config`` also print vLLM's ``SpecDecoding metrics`` line. MODEL defaults to the bundled
mlaq-tiny-4k checkpoint."""

from __future__ import annotations

import argparse
from typing import Any

from mlaq.cli.explain import add_quantization_argument


def _token_ids(text: str) -> list[int]:
    """``"1,2,3"``, ``"1 2 3"`` or ``"[1, 2, 3]"`` -> [1, 2, 3] (argparse turns a ValueError into one line)."""
    words = text.strip().removeprefix("[").removesuffix("]").replace(",", " ").split()
    if not words or not all(w.isdigit() for w in words):
        raise argparse.ArgumentTypeError(
            f"expected non-negative integers like 1,2,3 or [1, 2, 3], got {text!r}"
        )
    return [int(w) for w in words]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="checkpoint directory (config.json, safetensors, tokenizer.json; default: the bundled mlaq-tiny-4k)",
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument(
        "--prompt-token-ids",
        action="append",
        type=_token_ids,
        metavar="IDS",
        help="a prompt as token ids, '1,2,3' or '[1, 2, 3]' (repeat for a batch; no tokenizer.json needed)",
    )
    parser.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message (chat template)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='MTP speculative decoding, as vLLM: \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE",
        help='explicit per-layer BMM schemes: \'{"targets": {PATTERN: SCHEME}, "ignore": [PATTERN]}\'',
    )
    add_quantization_argument(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    add_compile_arguments(parser)


def add_compile_arguments(parser: argparse.ArgumentParser) -> None:
    """``--compile`` and vLLM's ``--compilation-config`` (``mlaq generate`` and ``mlaq serve``)."""
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run decode / MTP steps through torch.compile (inductor; compiles on first use)",
    )
    parser.add_argument(
        "--compilation-config",
        metavar="JSON",
        help='with --compile: \'{"inductor_compile_config": {"max_autotune": true}}\' (vLLM\'s JSON)',
    )


def run(args: argparse.Namespace) -> int:
    import sys
    import time

    from mlaq.bundled import model_or_default
    from mlaq.engine.llm import LLM
    from mlaq.engine.sampling_params import SamplingParams
    from mlaq.libc import keep_freed_memory
    from mlaq.policy.explicit import policy_config

    policy_config(args.quantization_config, args.quantization)  # a bad combination: one line, nothing loaded
    keep_freed_memory()  # batched decode makes and frees tens-of-MB tensors every step (mlaq.libc)
    warn_drafts_unusable("generate", _spec_k(args.speculative_config), "--max-tokens", args.max_tokens)
    llm = LLM(
        model_or_default(args.model),
        dtype=args.dtype,  # vLLM's names; LLM resolves them
        quantization_config=args.quantization_config,
        quantization=args.quantization,
        compile=args.compile,
        compilation_config=args.compilation_config,
        max_model_len=args.max_model_len,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
    )
    if bool(args.prompt) == bool(args.prompt_token_ids):
        raise ValueError("give prompts either as --prompt TEXT or as --prompt-token-ids IDS (one of the two)")
    prompts: list = list(args.prompt or [{"prompt_token_ids": ids} for ids in args.prompt_token_ids])
    if args.chat and args.prompt_token_ids:
        raise ValueError("--chat wraps text prompts; --prompt-token-ids are passed as they are")
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError("--chat needs the checkpoint's tokenizer.json")
        texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        prompts = [
            {"prompt": t, "prompt_token_ids": llm.tokenizer.encode(t, add_special_tokens=False)}
            for t in texts
        ]
    check_room(llm, prompts, args.max_tokens)
    start = time.perf_counter()
    if args.stream:
        if len(prompts) != 1:
            raise ValueError("--stream takes exactly one prompt")
        for delta in llm.generate_stream(prompts, params):
            sys.stdout.write(delta.outputs[0].text)
            sys.stdout.flush()
        print()
    else:
        for out in llm.generate(prompts, params):
            c = out.outputs[0]
            text = c.text if llm.tokenizer is not None else " ".join(map(str, c.token_ids))
            print(
                f"--- prompt {out.request_id} ({len(out.prompt_token_ids)} tokens) -> {len(c.token_ids)} tokens, "
                f"finish_reason={c.finish_reason}"
            )
            print(text)
    stats = llm.spec_decoding_stats
    if stats is not None:
        print(stats.log_line(time.perf_counter() - start))
    return 0


def check_room(llm: Any, prompts: list, max_tokens: int) -> None:
    """Prompt + --max-tokens must fit the context, as ``mlaq serve`` answers 400 (never silently capped)."""
    config = llm.engine.config
    m, limit = config.max_model_len, config.max_position_embeddings
    for i, p in enumerate(prompts):
        if not isinstance(p, dict) and llm.tokenizer is None:
            continue  # the engine says a text prompt needs tokenizer.json
        ids = p["prompt_token_ids"] if isinstance(p, dict) else llm.tokenizer.encode(p)
        if len(ids) + max_tokens <= m or len(ids) > m:  # a prompt over the context: the engine's advice
            continue
        room = max(m - len(ids), 0)
        bigger = f" or raise --max-model-len (the model takes up to {limit})" if limit and limit > m else ""
        raise ValueError(
            f"prompt {i} has {len(ids)} tokens and --max-tokens {max_tokens} asks for {len(ids) + max_tokens}, "
            f"over the context of {m} tokens (max_model_len): lower --max-tokens to at most {room}{bigger}"
        )


def _spec_k(text: str | None) -> int:
    from mlaq.engine.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(text)
    return 0 if spec is None else spec.num_speculative_tokens


def warn_drafts_unusable(command: str, k: int, flag: str, max_tokens: int | None) -> None:
    """A warning on stderr when k drafts per step exceed what a request of ``max_tokens`` can use:
    drafts are capped at max_tokens - 1 per step (vLLM's scheduler caps the tokens of a step at
    prompt + max_tokens - 1), so acceptance is measured on fewer drafts than asked for."""
    import sys

    if k and max_tokens is not None and k > max_tokens - 1:
        print(
            f"mlaq {command}: warning: {k} speculative tokens per step exceed what {flag} {max_tokens} can "
            f"use; each step drafts at most {max(max_tokens - 1, 0)} (max_tokens - 1), as vLLM's scheduler caps it",
            file=sys.stderr,
        )
