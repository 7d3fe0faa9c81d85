"""How close ``compile=True``'s greedy decode stays to eager's (the reference arithmetic) on one checkpoint.

    python bench/compiled_parity.py [--model DIR] [--attention mlaq torch] [--prompts 8] [--new-tokens 64]
        [--threads 2] [--dtype bfloat16]

Random prompts of 100-600 token ids (seeded), all in one batch, greedy, ignore_eos, chosen-token logprobs. For
each ``attention`` kernel of ``CompiledLatentLM`` (mlaq's C kernel, torch's fused kernel), against eager: per row,
the tokens up to the first difference, and the mean / max absolute difference of the chosen tokens' logprobs
over the common prefix. Not a test (docs/generate.md; figures in bench/RESULTS.md, "Engine speed").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mlaq.engine.compiled import CompiledLatentLM  # noqa: E402
from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.sampling_params import SamplingParams  # noqa: E402
from mlaq.libc import keep_freed_memory  # noqa: E402
from mlaq.model import load_model  # noqa: E402


def greedy(llm: LLM, prompts: list[list[int]], new: int) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append((list(c.token_ids), [lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True)]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--attention", nargs="+", default=["mlaq", "torch"], choices=["mlaq", "torch"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    keep_freed_memory()
    dtype = getattr(torch, a.dtype)
    rng = random.Random(0)
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(100, 601))] for _ in range(a.prompts)]
    kw = {"max_num_seqs": a.prompts, "dtype": dtype}
    eager = greedy(LLM(a.model, **kw), prompts, a.new_tokens)
    print(
        f"{a.model.name}, {a.dtype}, {a.prompts} prompts of 100-600 tokens in one batch, {a.new_tokens} greedy tokens"
    )
    for attention in a.attention:
        model = CompiledLatentLM(load_model(a.model, dtype=dtype), attention=attention)
        rows = greedy(LLM(model, max_num_seqs=a.prompts), prompts, a.new_tokens)
        same, diffs = [], []
        for (mine, my_lp), (ref, ref_lp) in zip(rows, eager, strict=True):
            n = next((i for i, (x, y) in enumerate(zip(mine, ref, strict=True)) if x != y), len(ref))
            same.append("all" if n == len(ref) else str(n))
            diffs += [abs(x - y) for x, y in zip(my_lp[:n], ref_lp[:n], strict=True)]
        print(
            f"attention={attention}: tokens equal to eager's until {', '.join(same)}; chosen-token logprobs "
            f"mean / max abs diff {sum(diffs) / len(diffs):.4f} / {max(diffs):.4f} nats"
        )


if __name__ == "__main__":
    main()
