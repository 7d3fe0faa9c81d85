"""Routed experts as stacked GEMMs (``MoE.stack_experts``) against one GEMM per chosen expert.

    python bench/moe_stacked.py [--model src/mlaq/assets/mlaq-tiny-4k] [--tokens 1 4 8 16 32] [--threads 2]

The loader stacks every MoE layer's routed-expert weights; from 2 to ``STACKED_MAX`` tokens
``MoE.forward`` then computes every routed expert for every token with two linears and one batched
matmul (E / k times the multiply-adds, 3 oneDNN calls instead of ~3 per chosen expert) and sums each
token's chosen experts as the per-expert paths do. Times the first MoE layer of the checkpoint (bf16,
real routing) both ways, in one process, and says whether the outputs are bit-identical. Not a test:
times depend on the machine.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch

from mlaq.libc import keep_freed_memory
from mlaq.model.layers.moe import MoE
from mlaq.model.loading.loader import load_model
from mlaq.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def layer(moe: MoE, stacked: tuple[torch.Tensor, ...] | None, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer with its stacked weights on (the loader's state) or off (one GEMM per expert)."""
    moe._stacked = stacked
    return moe(x)


def timed(fn, repeats: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.bfloat16, settings=Settings(), load_mtp=False)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    stacked = moe._stacked
    g = torch.Generator().manual_seed(0)
    print(f"{args.model.name}: first MoE layer, bf16, {args.threads} thread(s)")
    print("tokens | per-expert us | stacked us | ratio | bit-identical")
    for t in args.tokens:
        x = (torch.randn(t, model.config.hidden_size, generator=g) * 0.5).bfloat16()
        with torch.no_grad():
            want, got = layer(moe, None, x), layer(moe, stacked, x)
            a = timed(functools.partial(layer, moe, None, x))
            b = timed(functools.partial(layer, moe, stacked, x))
        diff = float((got.float() - want.float()).abs().max())
        print(
            f"{t:6d} | {a:10.0f} | {b:10.0f} | {b / a:5.2f}x | {torch.equal(got, want)} (max abs diff {diff:.3g})"
        )


if __name__ == "__main__":
    main()
