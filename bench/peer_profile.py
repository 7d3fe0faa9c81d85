"""Where mlaq's engine spends prefill and batched-decode time: torch.profiler over ``mlaq.LLM``.

    python bench/peer_profile.py [--model DIR] [--prompt-len 2048] [--batch 1] [--decode-batch 8]
        [--new-tokens 16] [--decode-prompt-len 64] [--threads 1] [--dtype bfloat16] [--rows 15]

Two phases on the same engine, bf16 by default, greedy, ignore_eos, random token ids: prefill
(``generate(max_tokens=1)`` of --batch prompts of --prompt-len tokens) and decode (--decode-batch
prompts of --decode-prompt-len tokens, default 64, --new-tokens new ones; their prefill is included). A warm-up call of each shape
runs first. Prints wall and CPU time (user+sys) per phase and the top operators by self CPU time.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.sampling_params import SamplingParams  # noqa: E402


def prompts(n: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = random.Random(length * 1009 + n)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(n)]


def phase(llm: LLM, name: str, batch: list[dict[str, list[int]]], new: int, rows: int, shapes: bool) -> None:
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(batch, sp)  # warm-up of this shape
    t0, c0 = time.perf_counter(), os.times()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        llm.generate(batch, sp)
    wall, c1 = time.perf_counter() - t0, os.times()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    print(f"\n== {name}: wall {wall:.2f} s, CPU user+sys {cpu:.2f} s (profiler on)")
    avg = prof.key_averages(group_by_input_shape=shapes)
    print(
        avg.table(
            sort_by="self_cpu_time_total",
            row_limit=rows,
            max_name_column_width=40,
            max_shapes_column_width=70,
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--decode-batch", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--decode-prompt-len", type=int, default=64, help="context of the decode phase's prompts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--compile", action="store_true", help="mlaq.LLM(compile=True)")
    p.add_argument("--shapes", action="store_true", help="group operators by input shape")
    p.add_argument("--skip", choices=("prefill", "decode"), default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    vocab = 4096
    llm = LLM(
        a.model,
        dtype=getattr(torch, a.dtype),
        max_model_len=max(a.prompt_len, a.decode_prompt_len) + a.new_tokens + 8,
        max_num_seqs=max(a.batch, a.decode_batch),
        compile=a.compile,
    )
    if a.skip != "prefill":
        phase(
            llm,
            f"prefill {a.batch} x {a.prompt_len}",
            prompts(a.batch, a.prompt_len, vocab),
            1,
            a.rows,
            a.shapes,
        )
    if a.skip != "decode":
        batch = prompts(a.decode_batch, a.decode_prompt_len, vocab)
        name = f"decode batch {a.decode_batch} x {a.decode_prompt_len}-token prompts, {a.new_tokens} new"
        phase(llm, name, batch, a.new_tokens, a.rows, a.shapes)


if __name__ == "__main__":
    main()
