"""Decode tokens/s with the runner's resident latents in float32 (the default), in bf16, and without
them (the paged cache gathered every call), alternated in one process.

    python bench/resident_ab.py BATCH [--prompt-len 512] [--new-tokens 48] [--rounds 3] [--threads 2]

``mlaq.LLM`` on the bundled mlaq-tiny-4k, bf16, greedy, ignore_eos, random prompt ids; decode =
(generate N+1 tokens - generate 1) / N. Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.resident import ResidentLatents  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from decode_budget import ab_setup, decode_rate  # noqa: E402


def main() -> None:
    a, prompts = ab_setup(__doc__)
    llm = LLM(a.model, dtype=torch.bfloat16, max_num_seqs=max(a.batch, 16))

    modes = {
        "float32 buffer": lambda: ResidentLatents(torch.float32),
        "bf16 buffer": lambda: ResidentLatents(torch.bfloat16),
        "gather every call": lambda: None,
    }
    decode_rate(llm, prompts, 4)
    print(f"batch {a.batch} x {a.prompt_len}-token prompts, decode tokens/s per round: " + " / ".join(modes))
    for _ in range(a.rounds):
        rates = []
        for make in modes.values():
            llm.engine.runner.resident = make()
            rates.append(f"{decode_rate(llm, prompts, a.new_tokens):.0f}")
        print(" / ".join(rates), flush=True)


if __name__ == "__main__":
    main()
