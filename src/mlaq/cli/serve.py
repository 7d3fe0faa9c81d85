"""``mlaq serve [MODEL]`` — an OpenAI-compatible server over mlaq's engine, with ``vllm serve``'s flags.

MODEL defaults to the bundled mlaq-tiny-4k checkpoint. Binds 127.0.0.1 unless ``--host`` says otherwise. Needs the
``serve`` extra: ``pip install 'mlaq[serve]'``.
"""

from __future__ import annotations

import argparse

from mlaq.cli.explain import add_quantization_argument
from mlaq.cli.generate import add_compile_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="checkpoint directory or a bundled model's name (default: the bundled mlaq-tiny-4k; also mlaq-tiny-16k)",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 = all)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; default 8000)")
    parser.add_argument(
        "--served-model-name", metavar="NAME", help="the model name clients send (default: MODEL)"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (prompt + output)")
    parser.add_argument(
        "--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="prompt tokens prefilled in one step, at least --max-model-len (default: --max-model-len)",
    )
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"])
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='MTP speculative decoding: \'{"method": "mtp", "num_speculative_tokens": 3}\'',
    )
    parser.add_argument(
        "--quantization-config",
        metavar="JSON|@FILE",
        help='explicit per-layer BMM schemes: \'{"targets": {PATTERN: SCHEME}, "ignore": [PATTERN]}\'',
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $VLLM_API_KEY, which keeps the "
        "key out of the process list; the flag wins)",
    )
    add_quantization_argument(parser)
    add_compile_arguments(parser)
    parser.add_argument("--seed", type=int, default=0, help="seeds requests that bring no seed of their own")
    parser.add_argument(
        "--max-waiting", type=int, default=256, help="waiting requests beyond this get 503 (default 256)"
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="request bodies beyond this get 413 (default 8 MiB)",
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="largest logprobs / prompt_logprobs a request may ask (default 20; -1: no limit, and -1 "
        "in a request returns the whole vocabulary's logprobs, for exact KL)",
    )
    parser.add_argument(
        "--per-request-spec-decode-metrics",
        choices=["none", "summary", "detailed"],
        default="none",
        help="add metrics.speculative_decoding to each reply (vLLM's flag)",
    )
    parser.add_argument(
        "--return-tokens-as-token-ids", action="store_true", help="logprob tokens as 'token_id:N'"
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=10.0, help="seconds in-flight requests get on stop"
    )
    parser.add_argument(
        "--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )


def check_flags(args: argparse.Namespace) -> None:
    """Every flag's range, before the model loads (a minute on a big checkpoint): one line naming it."""
    import math

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be from 0 (any free port) to 65535, got {args.port}")
    at_least = {
        "--max-num-seqs": (args.max_num_seqs, 1),
        "--max-model-len": (args.max_model_len, 1),
        "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
        "--max-waiting": (args.max_waiting, 0),
        "--max-body-bytes": (args.max_body_bytes, 1024),
        "--max-logprobs": (args.max_logprobs, -1),
    }
    for flag, (value, low) in at_least.items():
        if value is not None and value < low:
            raise ValueError(f"{flag} must be at least {low}, got {value}")
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")


def run(args: argparse.Namespace) -> int:
    import logging

    from mlaq.bundled import model_or_default
    from mlaq.libc import keep_freed_memory
    from mlaq.policy.explicit import policy_config
    from mlaq.serve.server import EngineArgs, bind, build_state, run_server, warn_if_exposed
    from mlaq.settings import serve_api_key

    check_flags(args)
    policy_config(
        args.quantization_config, args.quantization
    )  # a bad combination fails before the port opens
    api_key = serve_api_key(args.api_key)
    level = getattr(logging, args.uvicorn_log_level.upper())
    logging.basicConfig(level=level, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"mlaq serve needs the serve extra ({exc.name} is missing): pip install 'mlaq[serve]'"
        ) from None
    sock = bind(args.host, args.port)  # a taken port fails now, not after the model loads
    warn_if_exposed(args.host, api_key)
    keep_freed_memory()  # batched decode's tens-of-MB temporaries; idle steps trim (mlaq.libc)
    engine_args = EngineArgs(
        model=model_or_default(args.model),
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        speculative_config=args.speculative_config,
        quantization_config=args.quantization_config,
        quantization=args.quantization,
        compile=args.compile,
        compilation_config=args.compilation_config,
        seed=args.seed,
    )
    state = build_state(
        engine_args,
        served_model_name=args.served_model_name,
        api_key=api_key,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        max_logprobs=args.max_logprobs,
        per_request_spec_decode_metrics=args.per_request_spec_decode_metrics,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
    )
    return run_server(state, sock, args.host, args.shutdown_timeout, args.uvicorn_log_level)
