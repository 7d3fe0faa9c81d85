"""Independent oracles for mlaq.formats, and tests of the oracles themselves.

Written on purpose unlike the torch code under test: E8M0 rules from fp32 bit fields (numpy ints)
and exact rational arithmetic (fractions.Fraction); elements through ml_dtypes; FP8 blocks by a plain
loop over blocks. Other test_formats_* files import from here.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest

# element -> (emax, max, mbits, ml_dtypes type)
ELEM = {
    "E2M1": (2, 6.0, 1, ml_dtypes.float4_e2m1fn),
    "E4M3": (8, 448.0, 3, ml_dtypes.float8_e4m3fn),
    "E5M2": (15, 57344.0, 2, ml_dtypes.float8_e5m2),
}
FP8 = {
    "E4M3FN": ml_dtypes.float8_e4m3fn,
    "E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
    "E5M2": ml_dtypes.float8_e5m2,
}


def floor_log2_bits(a: np.ndarray) -> np.ndarray:
    """floor(log2 a) of positive finite fp32 values, from the bit fields (subnormals by bit length)."""
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.int64)
    expo, man = bits >> 23, bits & 0x7FFFFF
    sub_len = np.array([int(m).bit_length() for m in man.ravel()], dtype=np.int64).reshape(man.shape)
    return np.where(expo > 0, expo - 127, -150 + sub_len)


def is_pow2_bits(a: np.ndarray) -> np.ndarray:
    bits = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.int64)
    expo, man = bits >> 23, bits & 0x7FFFFF
    return np.where(expo > 0, man == 0, (man & (man - 1)) == 0)


def _ceil_log2_fraction(q: Fraction) -> int:
    k = q.numerator.bit_length() - q.denominator.bit_length() - 2
    while Fraction(2) ** k < q:
        k += 1
    return k


def _floor_log2_fraction(q: Fraction) -> int:
    k = q.numerator.bit_length() - q.denominator.bit_length() + 2
    while Fraction(2) ** k > q:
        k -= 1
    return k


def scale_byte_oracle(amax: np.ndarray, elem: str, rule: str) -> np.ndarray:
    """E8M0 byte per amax (fp32 array), as formats.md defines each rule."""
    emax, vmax, mbits, _ = ELEM[elem]
    a = np.asarray(amax, dtype=np.float32)
    out = np.zeros(a.shape, dtype=np.int64)
    finite_pos = np.isfinite(a) & (a > 0)
    v = np.where(finite_pos, a, np.float32(1))
    if rule == "FLOOR":
        u = floor_log2_bits(v) - emax
    elif rule == "CEIL":
        u = floor_log2_bits(v) + (~is_pow2_bits(v)) - emax
    elif rule == "RCEIL":
        u = np.array([_ceil_log2_fraction(Fraction(float(x)) / Fraction(vmax)) for x in v.ravel()])
    elif rule == "EVEN":
        # round the significand to mbits fractional bits, half away from zero, then floor(log2)
        us = []
        for x in v.ravel():
            q = Fraction(float(x))
            k = _floor_log2_fraction(q)
            step = Fraction(2) ** (k - mbits)
            rounded = math.floor(q / step + Fraction(1, 2)) * step
            # the kernels round in fp32: a rounded amax >= 2^128 is +inf there, and
            # clamp(log2(inf) - emax) = 127 (AITER _mxfp4_quant_op / Quark even rounding)
            us.append(127 if rounded >= Fraction(2) ** 128 else _floor_log2_fraction(rounded) - emax)
        u = np.array(us)
    else:
        raise ValueError(rule)
    u = np.asarray(u).reshape(a.shape)
    out = np.clip(u, -127, 127) + 127
    out = np.where(a == 0, 0, out)
    return np.where(np.isfinite(a), out, 255).astype(np.uint8)


def mx_oracle(
    x: np.ndarray, elem: str, rule: str, block: int = 32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MX along the last axis: (scale bytes (..., nb), element codes (..., K) uint8, dequantized fp32)."""
    x = np.asarray(x, dtype=np.float32)
    _, vmax, _, mld = ELEM[elem]
    k = x.shape[-1]
    nb = -(-k // block)
    scales = np.zeros((*x.shape[:-1], nb), np.uint8)
    codes = np.zeros(x.shape, np.uint8)
    deq = np.zeros(x.shape, np.float32)
    for j in range(nb):
        sl = x[..., j * block : (j + 1) * block]
        amax = np.abs(sl).max(axis=-1)
        amax = np.where(np.isnan(sl).any(axis=-1), np.float32("nan"), amax)
        s = scale_byte_oracle(amax, elem, rule)
        scales[..., j] = s
        p = np.ldexp(1.0, (s.astype(np.int64) - 127))[..., None]  # float64, exact
        y = np.clip((sl.astype(np.float64) / p).astype(np.float32), -vmax, vmax).astype(mld)
        bad = (s == 255)[..., None]
        c = np.where(bad, 0, y.view(np.uint8))
        codes[..., j * block : (j + 1) * block] = c
        deq[..., j * block : (j + 1) * block] = np.where(bad, np.nan, y.astype(np.float64) * p).astype(
            np.float32
        )
    return scales, codes, deq


def fp8_block_oracle(x: np.ndarray, fp8: str, block: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Plain loop over blocks: (fp32 scale per block, code bytes). Zero block -> scale 1."""
    mld = FP8[fp8]
    fmax = np.float32(float(ml_dtypes.finfo(mld).max))
    x = np.asarray(x, dtype=np.float32)
    lens = [d if b is None else b for d, b in zip(x.shape, block, strict=True)]
    grid = [-(-d // b) for d, b in zip(x.shape, lens, strict=True)]
    scale = np.zeros(grid, np.float32)
    codes = np.zeros(x.shape, np.uint8)
    for idx in itertools.product(*map(range, grid)):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, lens, strict=True))
        amax = np.float32(np.abs(x[sl]).max())
        s = np.float32(1) if amax == 0 else np.float32(amax / fmax)
        scale[idx] = s
        codes[sl] = np.clip(x[sl] / s, -fmax, fmax).astype(mld).view(np.uint8)
    return scale, codes


# ---- the oracles checked against hand-worked values ----


def test_oracle_scale_rules_by_hand():
    a = np.array([1.0, 4.0, 6.0, 7.0, 2.0**-130], np.float32)
    # 7 = 1.75 * 2^2: FLOOR 2-2=0; EVEN rounds 1.75 -> 2 (1 mantissa bit) -> 3-2=1; CEIL 3-2=1;
    # RCEIL ceil(log2(7/6)) = 1. 6: RCEIL 0, CEIL 1. Subnormal amax clamps to byte 0.
    assert scale_byte_oracle(a, "E2M1", "FLOOR").tolist() == [125, 127, 127, 127, 0]
    assert scale_byte_oracle(a, "E2M1", "EVEN").tolist() == [125, 127, 127, 128, 0]
    assert scale_byte_oracle(a, "E2M1", "CEIL").tolist() == [125, 127, 128, 128, 0]
    assert scale_byte_oracle(a, "E2M1", "RCEIL").tolist() == [125, 127, 127, 128, 0]
    assert scale_byte_oracle(np.array([0.0, np.nan, np.inf], np.float32), "E4M3", "EVEN").tolist() == [
        0,
        255,
        255,
    ]


@pytest.mark.parametrize("x", [1e-45, 1.17e-38, 3.0e-39, 1.0, 1.5, 3.4e38])
def test_oracle_floor_log2_matches_frexp(x):
    f = float(np.float32(x))
    assert floor_log2_bits(np.array([f], np.float32))[0] == math.frexp(f)[1] - 1


def test_oracle_mx_by_hand():
    x = np.zeros((1, 32), np.float32)
    x[0, :8] = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # amax 4 -> FLOOR u = 0, ties to even
    s, c, d = mx_oracle(x, "E2M1", "FLOOR")
    assert s.tolist() == [[127]]
    assert d[0, :8].tolist() == [4.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert c[0, :3].tolist() == [6, 0, 2]
