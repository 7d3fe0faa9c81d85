"""bf16 matrix products on CPUs without native bf16.

On a CPU with AVX512_BF16 or AMX, torch's bf16 GEMM (oneDNN) multiplies bf16 natively and accumulates in
fp32. On an AVX2-only CPU (e.g. AMD EPYC Zen 3) the same call falls back to a reference kernel that runs
about 100x slower than an fp32 GEMM of the same shape (measured: 2048x256 @ 256x768 in 0.8 s against
0.06 s), which makes a bf16 model unusable there.

Upcasting is exact where it matters: the product of two bf16 numbers is exact in fp32, so
``F.linear(x.float(), w.float()).to(bfloat16)`` computes what a bf16 GEMM with fp32 accumulation
computes — fp32 sums of exact products, rounded once to bf16 — up to the order of the sum, which no GEMM
fixes anyway. Only GEMMs (>= GEMM_ROWS rows) take this path: a bf16 GEMV is fast natively everywhere.

:func:`linear` is F.linear with that one exception; :func:`use_gemm_linears` makes a loaded model's
nn.Linear modules use it. Nothing changes on a CPU with native bf16, nor for fp32 models.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GEMM_ROWS = 8  # from here on, a native bf16 product is slow on AVX2 (measured: 4 rows 0.18 ms, 8 rows 2.5 ms)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512_BF16 or AMX-BF16, from /proc/cpuinfo); True where
    /proc/cpuinfo does not exist (not Linux on x86: leave torch's choice alone)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True
    if "flags" not in flags:  # not an x86 cpuinfo
        return True
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def fp32_gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """A bf16 linear computed as fp32 sums of exact products, rounded once to bf16."""
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(torch.bfloat16)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, except a bf16 GEMM (>= GEMM_ROWS rows) on a CPU without native bf16 runs fp32_gemm."""
    if x.dtype == torch.bfloat16 and x.numel() >= GEMM_ROWS * x.shape[-1] and not cpu_has_native_bf16():
        return fp32_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) whose products go through :func:`linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def use_gemm_linears(model: nn.Module) -> int:
    """Make every plain nn.Linear of a loaded model a :class:`Linear` (parameters untouched): on a CPU with
    native bf16, or for fp32, it computes exactly what nn.Linear does. Returns how many changed."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Linear
            changed += 1
    return changed
