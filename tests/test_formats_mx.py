"""quantize_mx / mx_fake_quant / MxTensor against the numpy + ml_dtypes oracle, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaq.formats import MxElem, MxTensor, ScaleRule, mx_fake_quant, quantize_mx
from test_formats_oracle import mx_oracle

CASES = [(e, r) for e in MxElem for r in ScaleRule]
IDS = [f"{e.name}-{r.name}" for e, r in CASES]


def _hard_data(rows: int = 24, k: int = 200, seed: int = 0) -> torch.Tensor:
    """Blocks spanning 2^-140 .. 2^100 (fp32 subnormal amax included), exact ties, an all-zero block,
    and a ragged tail (K=200 = 6 x 32 + 8)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g, dtype=torch.float64)
    mag = torch.randint(-140, 100, (rows, 1), generator=g).double()
    x = (x * torch.exp2(mag)).float()
    x[0, 32:64] = 0.0  # all-zero block
    x[1, :8] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])  # E2M1 ties at scale 1
    x[1, 8:32] = 0.0
    x[2, :32] = 2.0**-135  # subnormal amax, a power of two
    x[3, :32] = torch.linspace(-6, 6, 32) * 2.0**20
    return x


def _assert_same(a: torch.Tensor, b: torch.Tensor | np.ndarray) -> None:
    b = torch.as_tensor(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    keep = ~torch.isnan(a)
    assert torch.equal(a[keep], b[keep]), "values differ"
    # signed zeros too
    assert torch.equal(torch.signbit(a[keep]), torch.signbit(b[keep]))


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_quantize_matches_oracle_bit_exact(elem, rule):
    x = _hard_data()
    q = quantize_mx(x, elem, rule)
    s, c, d = mx_oracle(x.numpy(), elem.name, rule.name)
    assert q.scales.shape == (24, 7) and q.codes.shape == (24, 200)
    np.testing.assert_array_equal(q.scales.numpy(), s)
    np.testing.assert_array_equal(q.codes.numpy(), c)
    _assert_same(q.dequantize(), d)
    _assert_same(mx_fake_quant(x, elem, rule), d)  # the fast path is pinned to the same bits


@pytest.mark.parametrize(("elem", "rule"), CASES, ids=IDS)
def test_fake_quant_equals_dequantize_on_gaussians(elem, rule):
    x = torch.randn(64, 4, 192, generator=torch.Generator().manual_seed(3))
    for axis in (0, 1, 2, -1):
        _assert_same(
            mx_fake_quant(x, elem, rule, axis=axis), quantize_mx(x, elem, rule, axis=axis).dequantize()
        )


def test_axis_is_a_transpose():
    x = _hard_data(k=96)
    q0 = quantize_mx(x.T.contiguous(), MxElem.E2M1, ScaleRule.EVEN, axis=0)
    q1 = quantize_mx(x, MxElem.E2M1, ScaleRule.EVEN, axis=1)
    assert q0.scales.shape == (3, 24)
    assert torch.equal(q0.scales, q1.scales.T) and torch.equal(q0.codes, q1.codes.T)
    # a 3-D weight (N, K, M) quantized along K = 1, K = 192 ragged against 128-blocks is fine for 32
    w = torch.randn(2, 192, 5)
    q = quantize_mx(w, MxElem.E2M1, ScaleRule.EVEN, axis=1)
    assert q.scales.shape == (2, 6, 5) and q.packed().shape == (2, 96, 5)


def test_ragged_tail_amax_over_present_elements():
    x = torch.zeros(1, 40)
    x[0, :32] = 100.0
    x[0, 32:] = 1.0  # tail block of 8: amax 1 -> FLOOR u = -2, decodes exactly
    q = quantize_mx(x, MxElem.E2M1, ScaleRule.FLOOR)
    assert q.scales.tolist() == [[127 + 6 - 2, 127 - 2]]
    assert torch.equal(q.dequantize()[0, 32:], x[0, 32:])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("elem", list(MxElem), ids=lambda e: e.name)
def test_nan_and_inf_poison_exactly_their_block(bad, elem):
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(1))
    x[1, 40] = bad
    q = quantize_mx(x, elem, ScaleRule.RCEIL)
    assert q.scales[1, 1] == 0xFF and (q.codes[1, 32:64] == 0).all()
    d = q.dequantize()
    assert torch.isnan(d[1, 32:64]).all()
    assert (
        not torch.isnan(d[0]).any() and not torch.isnan(d[1, :32]).any() and not torch.isnan(d[1, 64:]).any()
    )
    _assert_same(mx_fake_quant(x, elem, ScaleRule.RCEIL), d)


def test_zero_block_and_subnormal_amax():
    x = torch.zeros(3, 32)
    x[1, 0] = 2.0**-130  # FLOOR: u would be -132, clamped to -127: element 2^-3 -> 0 in E2M1, exact in E4M3
    x[2, 0] = -(2.0**-149)
    for elem in MxElem:
        q = quantize_mx(x, elem, ScaleRule.FLOOR)
        assert q.scales[:, 0].tolist() == [0, 0, 0]
        assert (q.codes[0] == 0).all() and torch.equal(q.dequantize()[0], torch.zeros(32))
    assert quantize_mx(x, MxElem.E4M3, ScaleRule.FLOOR).dequantize()[1, 0] == 2.0**-130
    assert quantize_mx(x, MxElem.E2M1, ScaleRule.FLOOR).dequantize()[1, 0] == 0.0


def test_power_of_two_boundaries_rceil_vs_floor():
    six = 6.0 * 2.0**5
    above = float(np.nextafter(np.float32(six), np.float32(np.inf)))
    x = torch.tensor([[six] + [0.0] * 31, [above] + [0.0] * 31])
    q = quantize_mx(x, MxElem.E2M1, ScaleRule.RCEIL)
    assert q.scales[:, 0].tolist() == [127 + 5, 127 + 6]  # 6*2^5 fits at 2^5; one ulp more does not
    assert (
        q.dequantize()[0, 0] == six and q.dequantize()[1, 0] == 3.0 * 2.0**6
    )  # 3 * 2^6 = 192 again, now in range
    qf = quantize_mx(x, MxElem.E2M1, ScaleRule.FLOOR)
    assert qf.scales[:, 0].tolist() == [127 + 5, 127 + 5]  # floor(log2(192)) - 2 = 5: both clip to 6*2^5


def test_packed_round_trip_through_from_packed():
    x = torch.randn(8, 2, 70, generator=torch.Generator().manual_seed(5))  # odd K/2 handling via size
    for axis in (0, 2):
        q = quantize_mx(x, MxElem.E2M1, ScaleRule.EVEN, axis=axis)
        r = MxTensor.from_packed(q.packed(), q.scales, MxElem.E2M1, axis=axis, size=x.shape[axis])
        assert r.rule is None and torch.equal(r.codes, q.codes)
        _assert_same(r.dequantize(), q.dequantize())
    q8 = quantize_mx(x, MxElem.E4M3, ScaleRule.RCEIL)
    r8 = MxTensor.from_packed(
        q8.codes.view(torch.float8_e4m3fn), q8.scales.view(torch.float8_e8m0fnu), MxElem.E4M3
    )
    _assert_same(r8.dequantize(), q8.dequantize())


def test_from_packed_rejects_non_finite_and_bad_shapes():
    q = quantize_mx(torch.randn(4, 64), MxElem.E2M1, ScaleRule.EVEN)
    s = q.scales.clone()
    s[0, 0] = 0xFF
    with pytest.raises(ValueError, match="0xFF"):
        MxTensor.from_packed(q.packed(), s)
    with pytest.raises(ValueError, match="scales must be"):
        MxTensor.from_packed(q.packed(), q.scales[:, :1])
    q5 = quantize_mx(torch.randn(4, 64), MxElem.E5M2, ScaleRule.EVEN)
    inf = q5.codes.clone()
    inf[1, 1] = 0x7C  # +inf in e5m2
    with pytest.raises(ValueError, match="NaN/inf"):
        MxTensor.from_packed(inf, q5.scales, MxElem.E5M2)
    with pytest.raises(ValueError, match="only E2M1"):
        quantize_mx(torch.randn(4, 64), MxElem.E4M3, ScaleRule.EVEN).packed()
