"""Where an eager decode step's time goes, by difference: what decode speed is up against.

    python bench/decode_budget.py [--model DIR] [--batches 1 8 32] [--prompt-len 512] [--threads 2]
        [--new-tokens 48] [--repeats 3]

One process, ``mlaq.LLM`` (bf16, greedy, ignore_eos, random prompt ids), decode tokens/s =
(generate N+1 tokens - generate 1) / N, for each batch size under four conditions, alternated
``--repeats`` times (this VM's speed drifts; the best of each is printed):
- ``full``: the engine as it is, prompts of --prompt-len tokens;
- ``short context``: prompts of 16 tokens: the step without most of the attention over the cache;
- ``no float64``: full, but the bf16 scheme's absorbed BMMs as one float32 GEMM instead of mlaq's
  float64 emulation (a measurement only: the emulation is the project's contract);
- ``steps``: the same decode step count, and ``aten ops / step`` counted by torch.profiler.
Then the dispatch floor: the median cost of one tiny torch op on this machine, times the ops a
step runs, against the memory-bandwidth floor of ``bench/roofline.py``. Not a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mlaq.bmm.base import Bf16Reference  # noqa: E402
from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.sampling_params import SamplingParams  # noqa: E402
from mlaq.libc import keep_freed_memory  # noqa: E402


def float32_bmm(self, x, prepared):  # the bf16 scheme without its float64 sum (measurement only)
    return torch.bmm(x.to(torch.bfloat16).float(), prepared.weight.float()).to(torch.bfloat16).float()


def decode_rate(llm: LLM, prompts: list, new: int) -> float:
    times = []
    for m in (1, new + 1):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        times.append(time.perf_counter() - t0)
    return len(prompts) * new / (times[1] - times[0])


def ops_per_step(llm: LLM, prompts: list, new: int) -> float:
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    counts = []
    for m in (1, new + 1):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
        counts.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")))
    return (counts[1] - counts[0]) / new


def _parser(doc: str) -> argparse.ArgumentParser:
    """The options every decode measurement here takes: --model, --prompt-len, --new-tokens, --threads."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    return p


def _parse(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, set torch's threads and keep freed memory (no page faults between timed runs)."""
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    keep_freed_memory()
    return a


def ab_setup(doc: str, **choices: list[str]) -> tuple[argparse.Namespace, list]:
    """The arguments of the one-process A/B scripts (``resident_ab``, ``compiled_ab``): BATCH, --model,
    --prompt-len, --new-tokens, --rounds, --threads, and an option --NAME for each of ``choices`` (its
    first value the default); sets the threads and keeps freed memory. Returns the arguments and BATCH
    random prompts of --prompt-len token ids."""
    p = _parser(doc)
    for name, values in choices.items():
        p.add_argument(f"--{name}", choices=values, default=values[0])
    p.add_argument("batch", type=int)
    p.add_argument("--rounds", type=int, default=3)
    a = _parse(p)
    rng = random.Random(1)
    prompts = [
        {"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(a.prompt_len)]} for _ in range(a.batch)
    ]
    return a, prompts


def tiny_op_us(n: int = 20000) -> float:
    a, b = torch.ones(4), torch.ones(4)
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            torch.add(a, b)
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def main() -> None:
    p = _parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--repeats", type=int, default=3)
    a = _parse(p)
    llm = LLM(a.model, dtype=torch.bfloat16, max_num_seqs=max(a.batches))
    rng = random.Random(0)
    apply = Bf16Reference.apply
    print(f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {a.threads} threads")
    print(f"model: {a.model}; bf16; decode tokens/s, best of {a.repeats}")
    print("| batch | full | short context (16) | no float64 | ms/step full / short | aten ops / step |")
    print("|---|---|---|---|---|---|")
    for b in a.batches:
        full = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(a.prompt_len)]} for _ in range(b)]
        short = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(16)]} for _ in range(b)]
        decode_rate(llm, full, 4)
        best = {"full": 0.0, "short": 0.0, "no64": 0.0}
        for _ in range(a.repeats):
            best["full"] = max(best["full"], decode_rate(llm, full, a.new_tokens))
            best["short"] = max(best["short"], decode_rate(llm, short, a.new_tokens))
            Bf16Reference.apply = float32_bmm
            try:
                best["no64"] = max(best["no64"], decode_rate(llm, full, a.new_tokens))
            finally:
                Bf16Reference.apply = apply
        ops = ops_per_step(llm, full, 8)
        ms = [1000 * b / best[k] for k in ("full", "short")]
        print(
            f"| {b} | {best['full']:.0f} | {best['short']:.0f} | {best['no64']:.0f} "
            f"| {ms[0]:.1f} / {ms[1]:.1f} | {ops:.0f} |",
            flush=True,
        )
    us = tiny_op_us()
    print(f"\none tiny torch op (torch.add of 4 floats), median: {us:.2f} us on this machine")
    print("dispatch floor of a step = aten ops / step x that; compare with bench/roofline.py's floor")


if __name__ == "__main__":
    main()
