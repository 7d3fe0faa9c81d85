"""E8M0 scale rules against the independent oracle (bit fields + exact rationals), on every
positive bf16 amax, every boundary where a rule changes its answer, and random fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaq.formats import MxElem, ScaleRule, e8m0_decode, e8m0_scale_exponent
from test_formats_oracle import ELEM, scale_byte_oracle

CASES = [(e, r) for e in MxElem for r in ScaleRule]
IDS = [f"{e.name}-{r.name}" for e, r in CASES]


def _boundaries(elem: MxElem) -> np.ndarray:
    """Powers of two, max*2^k, and EVEN's carry points (2 - 2^-(mbits+1)) * 2^k, each ±1 ulp,
    over every exponent from subnormal to fp32 max, plus the extremes."""
    k = np.arange(-170, 129)
    base = [np.ldexp(1.0, k), elem.max * np.ldexp(1.0, k), (2 - 2.0 ** -(elem.mbits + 1)) * np.ldexp(1.0, k)]
    with np.errstate(over="ignore"):
        v = np.concatenate(base).astype(np.float32)
    v = v[np.isfinite(v) & (v > 0)]
    up = np.nextafter(v, np.float32(np.inf))
    down = np.nextafter(v, np.float32(0))
    extremes = np.array([np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45, 2.0**-127], np.float32)
    out = np.concatenate([v, up, down, extremes])
    return np.unique(out[np.isfinite(out) & (out > 0)])


def _all_positive_bf16() -> np.ndarray:
    bits = np.arange(1, 0x7F80, dtype=np.uint32) << 16  # every positive finite bf16, subnormals included
    return bits.view(np.float32)


def _ours(a: np.ndarray, e: MxElem, r: ScaleRule) -> np.ndarray:
    u = e8m0_scale_exponent(torch.from_numpy(a.copy()), e, r)
    return (u + 127).numpy().astype(np.int64)


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_rule_matches_oracle_on_boundaries(elem, rule):
    a = _boundaries(elem)
    np.testing.assert_array_equal(_ours(a, elem, rule), scale_byte_oracle(a, elem.name, rule.name))


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_rule_matches_oracle_on_all_bf16(elem, rule):
    a = _all_positive_bf16()
    np.testing.assert_array_equal(_ours(a, elem, rule), scale_byte_oracle(a, elem.name, rule.name))


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_rule_matches_oracle_on_random_fp32(elem, rule):
    rng = np.random.default_rng(7)
    bits = rng.integers(
        1, 0x7F800000, size=3000, dtype=np.uint32
    )  # uniform over positive finite fp32 patterns
    a = bits.view(np.float32)
    np.testing.assert_array_equal(_ours(a, elem, rule), scale_byte_oracle(a, elem.name, rule.name))


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_special_amax(elem, rule):
    a = torch.tensor([0.0, float("nan"), float("inf"), 1e-45, 2.0**-127])
    assert (e8m0_scale_exponent(a, elem, rule) + 127).tolist() == [0, 255, 255, 0, 0]


def test_properties_match_oracle_table():
    for e in MxElem:
        emax, vmax, mbits, _ = ELEM[e.name]
        assert (e.emax, e.max, e.mbits) == (emax, vmax, mbits)


def test_rules_differ_where_formats_md_says():
    """amax = 7 (E2M1): FLOOR 0, EVEN 1, RCEIL 1, CEIL 1; amax = 6: RCEIL 0 but CEIL 1;
    amax = 1 + 2^-23 above a power of two: CEIL rounds up where a float log2 would not."""
    f = lambda v, r: int(e8m0_scale_exponent(torch.tensor([v]), MxElem.E2M1, r))  # noqa: E731
    assert [f(7.0, r) for r in ScaleRule] == [0, 1, 1, 1]
    assert f(6.0, ScaleRule.RCEIL) == 0 and f(6.0, ScaleRule.CEIL) == 1
    assert f(1024 * (1 + 2**-23), ScaleRule.CEIL) == 11 - 2
    assert f(5.5, ScaleRule.EVEN) == 0  # 1.375 * 4 rounds to 1.5 * 4: no carry


def test_e8m0_decode():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    d = e8m0_decode(b)
    assert d[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(d[6])


def test_even_scale_at_fp32_overflow_matches_the_kernels() -> None:
    """A finite amax whose EVEN rounding overflows fp32 (>= 1.75 * 2^127 ~ 2.98e38 for E2M1) gets byte 254,
    as vLLM 0.32's Triton MXFP4 quantizer (utils/mxfp4_utils.py: rounded amax -> +inf, clamp -> 127),
    AITER dynamic_mxfp4_quant and Quark do; pinned bytes worked out by hand from that code."""
    edge = np.float32(1.75 * 2.0**127)
    below = np.nextafter(edge, np.float32(0))
    amax = torch.tensor([below, edge, 3.0e38, np.finfo(np.float32).max], dtype=torch.float32)
    got = (e8m0_scale_exponent(amax, MxElem.E2M1, ScaleRule.EVEN) + 127).tolist()
    assert got == [252, 254, 254, 254]
    # MXFP8 E4M3 carries at (2 - 2^-4) * 2^127
    edge8 = torch.tensor([np.nextafter(np.float32(1.9375 * 2.0**127), np.float32(0)), 1.9375 * 2.0**127])
    assert (e8m0_scale_exponent(edge8.float(), MxElem.E4M3, ScaleRule.EVEN) + 127).tolist() == [246, 254]
