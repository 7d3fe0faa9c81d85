"""NVIDIA Hopper (sm90) tensor-core sums, bit for bit (FP8 and bf16), and the fp32 FMA of a promotion step.

A ``wgmma`` does not sum exactly and round once. Fitted to an H200's outputs (``bench/fp8_hardware.py`` and
``bench/bf16_hardware.py`` with ``--dump``; the data is ``tests/fixtures/h200_*_dots.safetensors``) until
every output matched, for cuBLAS(Lt) and Triton's ``tl.dot`` alike, it works per k-step of products along
K (32 for FP8, 16 for bf16) together with the accumulator c:

1. each product ``a_i * b_i`` is exact; its exponent is taken as ``ea + eb``, the inputs' own exponents
   (subnormal inputs at the format's smallest normal exponent), not the product's renormalised one;
2. every term, c included, is aligned to the largest of those exponents E and truncated toward zero to
   a multiple of ``2^(E - F)``: F = 13 for FP8, 25 for bf16;
3. the aligned terms are summed exactly; the sum is normalised and truncated toward zero to 13 fraction
   bits for FP8 (an "e8m13" accumulator: the low 10 bits of every fp32 output are zero), to fp32's 23 for
   bf16; that is the next c.

Longer K chains the k-steps through c. For FP8 this is the "about 14 bits" of accumulation the DeepSeek-V3
report measured on H800, and why DeepGEMM promotes each 128-deep partial sum into an fp32 register:
``final += (scale_a * scale_b) * partial``, which nvcc contracts into one fused multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorCoreSum:
    """How one kind of sm90 ``wgmma`` sums: products per k-step, alignment bits, result bits."""

    name: str
    k_step: int  # products one instruction's k-step sums (with the accumulator)
    align_bits: int  # terms are truncated to 2^-align_bits of the largest exponent
    result_bits: int  # fraction bits the normalised sum keeps (truncated)
    min_exp: int  # exponent of the input format's subnormals (= its smallest normal exponent)


SM90_FP8 = TensorCoreSum("sm90 e4m3 x e4m3 -> f32", k_step=32, align_bits=13, result_bits=13, min_exp=-6)
# bf16 subnormal inputs at -126 by analogy with e4m3's: the H200 data held none (unverified)
SM90_BF16 = TensorCoreSum("sm90 bf16 x bf16 -> f32", k_step=16, align_bits=25, result_bits=23, min_exp=-126)
_NO_EXP = -(2**20)  # exponent given to zeros: never the largest
_TILE = 1 << 22  # products materialised at once


def _exponent(x: Tensor, min_exp: float = -float("inf")) -> Tensor:
    """floor(log2 |x|), at least ``min_exp``, in x's dtype; _NO_EXP for zeros (so that a product with a
    zero factor is never the largest term)."""
    _, e = torch.frexp(x)
    return torch.where(x == 0, torch.full_like(x, _NO_EXP), (e - 1).to(x.dtype).clamp(min=min_exp))


def _truncate(x: Tensor, exp: Tensor) -> Tensor:
    """x truncated toward zero to a multiple of 2^exp (exact)."""
    step = torch.pow(2.0, exp)
    return torch.trunc(x / step) * step


def _step(x: Tensor, x_exp: Tensor, w: Tensor, w_exp: Tensor, acc: Tensor, kind: TensorCoreSum) -> Tensor:
    """One k-step: x / x_exp (N, B, k), w / w_exp (N, k, M), acc (N, B, M) float64 on the result grid.

    The terms are formed in units of 2^(top - align_bits): there they are integers below
    2^(align_bits + 2), so float32 holds them (and their k_step sum) exactly for FP8 (13 bits); bf16 (25)
    works in float64. Truncating the scaled product is truncating the product to the grid."""
    prods = x.unsqueeze(3) * w.unsqueeze(1)  # (N, B, k, M), exact
    top = (x_exp.unsqueeze(3) + w_exp.unsqueeze(1)).amax(dim=2)  # (N, B, M): largest product exponent
    top = torch.maximum(top.double(), _exponent(acc)).clamp(min=-400)  # all-zero: any grid will do
    unit = top - kind.align_bits
    inv = torch.pow(2.0, -unit)  # float64: exact powers of two
    # a scale beyond the work dtype's range only happens where every product is zero (top came from acc)
    scale = inv.clamp(max=2.0**100 if prods.dtype == torch.float32 else 2.0**1000)
    prods.mul_(scale.to(prods.dtype).unsqueeze(2)).trunc_()  # exact: powers of two
    units = prods.sum(dim=2, dtype=prods.dtype).double() + torch.trunc(acc * inv)
    total = units / inv
    return torch.where(total == 0, total, _truncate(total, _exponent(total) - kind.result_bits))


def sm90_dot(x: Tensor, w: Tensor, acc: Tensor | None = None, kind: TensorCoreSum = SM90_FP8) -> Tensor:
    """What a Hopper wgmma chain of ``kind`` computes: (N, B, K) x (N, K, M) values of the input format
    (any float dtype holding them exactly) plus an optional fp32 accumulator (N, B, M) -> fp32 (N, B, M)."""
    n, b, k = x.shape
    m = w.shape[2]
    work = torch.float32 if kind.align_bits + 2 + kind.k_step.bit_length() <= 24 else torch.float64
    xd, wd = x.to(work), w.to(work)
    x_exp, w_exp = _exponent(xd, kind.min_exp), _exponent(wd, kind.min_exp)
    start = torch.zeros(n, b, m, dtype=torch.float64) if acc is None else acc.float().double()
    rows = max(1, _TILE // max(1, n * kind.k_step * m))  # tokens a tile of products holds
    out = []
    for b0 in range(0, b, rows):
        xs, xe, c = xd[:, b0 : b0 + rows], x_exp[:, b0 : b0 + rows], start[:, b0 : b0 + rows]
        for k0 in range(0, k, kind.k_step):
            k1 = min(k0 + kind.k_step, k)
            c = _step(xs[:, :, k0:k1], xe[:, :, k0:k1], wd[:, k0:k1], w_exp[:, k0:k1], c, kind)
        out.append(c)
    return torch.cat(out, dim=1).float()


def sm90_fp8_dot(xq: Tensor, wq: Tensor, acc: Tensor | None = None) -> Tensor:
    """``sm90_dot`` of e4m3fn code values (FP8 wgmma)."""
    return sm90_dot(xq, wq, acc, SM90_FP8)


def sm90_bf16_dot(x: Tensor, w: Tensor, acc: Tensor | None = None) -> Tensor:
    """``sm90_dot`` of bf16 values (bf16 wgmma, what cuBLAS's bf16 GEMMs run on Hopper)."""
    return sm90_dot(x.to(torch.bfloat16), w.to(torch.bfloat16), acc, SM90_BF16)


def fma_fp32(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """fp32 ``a * b + c`` with one rounding (CUDA's ``fmaf``), elementwise over broadcast fp32 tensors.

    a * b is exact in float64 (48 bits); the float64 sum is rounded to odd (its exact error, from
    TwoSum, nudges an inexact even result one ulp toward it), and a round-to-odd value with >= 2 more
    bits than fp32 rounds to fp32 exactly as the exact sum would.
    """
    p = a.double() * b.double()
    z = c.double()
    s = p + z
    bp = s - z
    err = (p - bp) + (z - (s - bp))  # TwoSum: s + err == p + z exactly
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64)
    s = torch.where((err != 0) & even, torch.nextafter(s, toward), s)
    return s.float()
