"""A lever for batched decode, measured before it is built: routed experts as stacked GEMMs.

    python bench/moe_stacked.py [--model src/mlaq/assets/mlaq-tiny-4k] [--tokens 8 32] [--threads 2]

mlaq's MoE (``mlaq.model.moe.MoE``) runs each chosen routed expert as three small linears over its
tokens; at decode batch sizes that is ~24 oneDNN calls a layer, each mostly per-call cost. The
alternative timed here computes every routed expert for every token with one linear for all gate
projections, one for all up projections and one batched matmul for the down projections (weights
stacked once), then sums each token's chosen experts in ascending expert order as ``MoE`` does (a zero
weight for the others adds exact zeros). It does E / k times the multiply-adds. Printed per token
count: the current layer's time, the stacked version's, and whether the outputs are bit-identical
(the same dot products through other GEMM calls may sum in another order). The first MoE layer of
the checkpoint, bf16, real routing. Not a test: times depend on the machine.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mlaq.libc import keep_freed_memory
from mlaq.model.loader import load_model
from mlaq.model.moe import MoE
from mlaq.settings import Settings

REPO = Path(__file__).resolve().parents[1]


def stacked(moe: MoE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E*I, H) gate, (E*I, H) up, (E, I, H) down^T: every routed expert's weights, stacked once."""
    experts = list(moe.experts)
    gate = torch.cat([e.gate_proj.weight for e in experts])
    up = torch.cat([e.up_proj.weight for e in experts])
    down_t = torch.stack([e.down_proj.weight.t() for e in experts])
    return gate, up, down_t


def routed_stacked(moe: MoE, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The routed experts' sum for tokens x (T, H), through the stacked weights."""
    gate_w, up_w, down_t = w
    e, i = down_t.shape[0], down_t.shape[1]
    weights, indices = moe.gate(x)  # (T, k)
    t = x.shape[0]
    h = (F.silu(F.linear(x, gate_w)) * F.linear(x, up_w)).view(t, e, i).transpose(0, 1)  # (E, T, I)
    y = torch.bmm(h, down_t)  # (E, T, H)
    dense = torch.zeros(t, e, dtype=torch.float32)
    dense.scatter_(1, indices, weights)  # (T, E): each token's weight per expert, 0 where not chosen
    out = torch.zeros_like(x)
    for j in range(e):  # ascending expert order, each contribution rounded as MoE rounds it
        out = out + (y[j] * dense[:, j, None]).to(x.dtype)
    return out


def with_shared(moe: MoE, x: torch.Tensor, w: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The whole layer as MoE.forward computes it: routed experts (stacked), plus the shared expert."""
    out = routed_stacked(moe, x, w)
    return out if moe.shared_experts is None else out + moe.shared_experts(x)


def timed(fn, repeats: int = 50) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 32])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=torch.bfloat16, settings=Settings(), load_mtp=False)
    moe = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MoE))
    w = stacked(moe)
    g = torch.Generator().manual_seed(0)
    print(f"{args.model.name}: first MoE layer, bf16, {args.threads} thread(s)")
    print("tokens | current routed+shared us | stacked routed + shared us | ratio | bit-identical")
    for t in args.tokens:
        x = (torch.randn(t, model.config.hidden_size, generator=g) * 0.5).bfloat16()
        with torch.no_grad():
            want = moe(x)
            got = with_shared(moe, x, w)
            a = timed(functools.partial(moe, x))
            b = timed(functools.partial(with_shared, moe, x, w))
        same = torch.equal(got, want)
        diff = float((got.float() - want.float()).abs().max())
        print(f"{t:6d} | {a:10.0f} | {b:10.0f} | {b / a:5.2f}x | {same} (max abs diff {diff:.3g})")


if __name__ == "__main__":
    main()
