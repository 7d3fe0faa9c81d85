"""NVIDIA Hopper (sm90) FP8 tensor-core arithmetic, bit for bit, and the fp32 FMA of the promotion step.

An FP8 ``wgmma`` (e4m3 x e4m3 -> f32) does not sum exactly and round once. Fitted to an H200's outputs
(``bench/fp8_hardware.py --dump``; the data is ``tests/fixtures/h200_fp8_dots.safetensors``) until every
output matched, for cuBLASLt's ``torch._scaled_mm`` and Triton's ``tl.dot`` alike, it works per 32
products along K (one FP8 k-step) together with the accumulator c:

1. each product ``a_i * b_i`` is exact; its exponent is taken as ``ea + eb``, the inputs' own exponents
   (subnormal inputs at -6), not the product's renormalised one;
2. every term, c included, is aligned to the largest of those exponents E and truncated toward zero to
   a multiple of ``2^(E - 13)``;
3. the aligned terms are summed exactly; the sum is normalised and truncated toward zero to 13 fraction
   bits, the next c (an "e8m13" accumulator: the low 10 bits of every fp32 output are zero).

Longer K chains the 32-steps through c. This is the "about 14 bits" of FP8 accumulation the DeepSeek-V3
report measured on H800, and why DeepGEMM promotes each 128-deep partial sum into an fp32 register:
``final += (scale_a * scale_b) * partial``, which nvcc contracts into one fused multiply-add.
"""

from __future__ import annotations

import torch
from torch import Tensor

SM90_FP8_K_STEP = 32  # products one FP8 wgmma k-step sums
SM90_FRACTION_BITS = 13  # fraction bits the accumulator keeps
_E4M3_MIN_EXP = -6  # exponent of e4m3fn subnormals and of its smallest normal
_NO_EXP = -(2**20)  # exponent given to zeros: never the largest
_TILE = 1 << 22  # products materialised at once (32 MB of float64)


def _exponent(x: Tensor) -> Tensor:
    """floor(log2 |x|) as float64, _NO_EXP for zeros."""
    _, e = torch.frexp(x)
    return torch.where(x == 0, torch.full_like(x, _NO_EXP), (e - 1).double())


def _truncate(x: Tensor, exp: Tensor) -> Tensor:
    """x truncated toward zero to a multiple of 2^exp (x, exp float64; exact)."""
    step = torch.pow(2.0, exp)
    return torch.trunc(x / step) * step


def _step(prods: Tensor, prod_exp: Tensor, acc: Tensor) -> Tensor:
    """One k-step: prods / prod_exp (N, B, k, M), acc (N, B, M) float64 on the e8m13 grid."""
    acc_exp = _exponent(acc)
    top = torch.maximum(prod_exp.amax(dim=2), acc_exp).clamp(min=-200)  # (N, B, M); all-zero: any grid
    shift = (top - SM90_FRACTION_BITS).unsqueeze(2)
    total = _truncate(prods, shift).sum(dim=2) + _truncate(acc, shift[:, :, 0])  # exact in float64
    return torch.where(total == 0, total, _truncate(total, _exponent(total) - SM90_FRACTION_BITS))


def sm90_fp8_dot(xq: Tensor, wq: Tensor, acc: Tensor | None = None) -> Tensor:
    """What a Hopper FP8 wgmma chain computes: (N, B, K) x (N, K, M) e4m3fn code values (any float
    dtype holding them exactly) plus an optional fp32 accumulator (N, B, M) -> fp32 (N, B, M)."""
    n, b, k = xq.shape
    m = wq.shape[2]
    x, w = xq.double(), wq.double()
    x_exp = torch.clamp(_exponent(x), min=_E4M3_MIN_EXP)
    w_exp = torch.clamp(_exponent(w), min=_E4M3_MIN_EXP)
    start = torch.zeros(n, b, m, dtype=torch.float64) if acc is None else acc.float().double()
    rows = max(1, _TILE // max(1, n * SM90_FP8_K_STEP * m))  # tokens a tile of products holds
    out = []
    for b0 in range(0, b, rows):
        xs, xe, c = x[:, b0 : b0 + rows], x_exp[:, b0 : b0 + rows], start[:, b0 : b0 + rows]
        for k0 in range(0, k, SM90_FP8_K_STEP):
            k1 = min(k0 + SM90_FP8_K_STEP, k)
            prods = xs[:, :, k0:k1, None] * w[:, None, k0:k1, :]  # exact: 8 significant bits
            exp = xe[:, :, k0:k1, None] + w_exp[:, None, k0:k1, :]
            c = _step(prods, torch.where(prods == 0, torch.full_like(exp, _NO_EXP), exp), c)
        out.append(c)
    return torch.cat(out, dim=1).float()


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
