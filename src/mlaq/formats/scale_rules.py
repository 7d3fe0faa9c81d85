"""OCP MX element types and the four E8M0 shared-scale rules (OCP MX spec v1.0 §5-6).

u is the block's scale exponent (scale = 2^u), clamped to [-127, 127]; the stored E8M0 byte is u + 127.
With a = block amax (fp32) and emax/max/mbits of the element type:
  FLOOR  u = floor(log2 a) - emax                     OCP spec §6.3, microxcaling, torchao default, Quark export
  EVEN   u = floor(log2 round(a, mbits)) - emax      AMD Quark default, AITER Triton dynamic_mxfp4_quant
  RCEIL  u = ceil(log2(a / max))                      NVIDIA cuBLAS/TE, DeepSeek ue8m0
  CEIL   u = ceil(log2 a) - emax                      torchao option
Special blocks: amax == 0 -> byte 0x00 (u = -127); NaN -> byte 0xFF (u = 128). mlaq also maps an
infinite amax to 0xFF: no finite scale can hold it, and a loud NaN block beats a block of silently
saturated values (torchao instead clamps u to 127 and saturates the elements).
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

E8M0_NAN = 0xFF
E8M0_BIAS = 127


class MxElem(Enum):
    """MX element types: E2M1 (MXFP4), E4M3 and E5M2 (MXFP8)."""

    E2M1 = "e2m1"
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @property
    def emax(self) -> int:
        """Exponent of the largest normal power of two: 2, 8, 15."""
        return {MxElem.E2M1: 2, MxElem.E4M3: 8, MxElem.E5M2: 15}[self]

    @property
    def max(self) -> float:
        """Largest finite magnitude: 6, 448, 57344."""
        return {MxElem.E2M1: 6.0, MxElem.E4M3: 448.0, MxElem.E5M2: 57344.0}[self]

    @property
    def mbits(self) -> int:
        """Explicit mantissa bits: 1, 3, 2."""
        return {MxElem.E2M1: 1, MxElem.E4M3: 3, MxElem.E5M2: 2}[self]


class ScaleRule(Enum):
    """How a block's amax becomes its E8M0 scale exponent (the table above)."""

    FLOOR = "floor"
    EVEN = "even"
    RCEIL = "rceil"
    CEIL = "ceil"


def e8m0_scale_exponent(amax: Tensor, elem: MxElem, rule: ScaleRule) -> Tensor:
    """Scale exponent u per block (int32, in [-127, 127]; 128 marks a NaN block, byte 0xFF).

    ``amax`` is taken as fp32 (non-negative). floor/ceil of log2 are computed exactly from
    ``frexp`` in float64, never from a floating log2 (which rounds log2(2^k (1 + 2^-23)) to k).
    """
    a = amax.float()
    if rule is ScaleRule.EVEN:
        # Round a to mbits mantissa bits on its fp32 bit pattern (half-up, may carry into the
        # exponent), keep the exponent field: floor(log2) of the rounded value. Exponent field 0
        # (subnormal) means floor(log2) <= -127, which clamps to -127 below anyway.
        bits = a.view(torch.int32).to(torch.int64) + (1 << (22 - elem.mbits))
        field = (bits >> 23) & 0xFF
        u = torch.where(field == 0, -E8M0_BIAS, field - E8M0_BIAS) - elem.emax
    else:
        d = a.double()
        if rule is ScaleRule.RCEIL:
            # a / max in float64 cannot land on a power of two unless the exact quotient does:
            # a has 24 significant bits and max = 3 * 2^1 or 7 * 2^j.
            d = d / elem.max
        mant, e = torch.frexp(d)  # d = mant * 2^e, mant in [0.5, 1)
        floor_log2 = e.to(torch.int64) - 1
        if rule is ScaleRule.FLOOR:
            u = floor_log2 - elem.emax
        else:
            ceil_log2 = floor_log2 + (mant != 0.5).to(torch.int64)
            u = ceil_log2 if rule is ScaleRule.RCEIL else ceil_log2 - elem.emax
    u = u.clamp(-E8M0_BIAS, E8M0_BIAS)
    u = torch.where(a == 0, -E8M0_BIAS, u)
    u = torch.where(torch.isfinite(a), u, E8M0_NAN - E8M0_BIAS)
    return u.to(torch.int32)


def e8m0_decode(scale_bytes: Tensor) -> Tensor:
    """E8M0 bytes -> fp32 scales 2^(byte-127); 0x00 -> 2^-127 (an fp32 subnormal), 0xFF -> NaN."""
    b = scale_bytes.to(torch.int32)
    s = torch.exp2((b - E8M0_BIAS).double()).float()  # exact: every 2^k, k in [-127, 127], is an fp32
    return torch.where(b == E8M0_NAN, torch.full_like(s, float("nan")), s)
