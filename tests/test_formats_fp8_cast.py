"""fp8_cast and the FP8 element types, bit-exact against ml_dtypes (exhaustive where feasible)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.formats import Fp8Dtype, fp8_cast
from test_formats_oracle import FP8

ALL = list(Fp8Dtype)


def _all_bf16_as_fp32() -> torch.Tensor:
    """Every one of the 65,536 bf16 bit patterns (NaNs and infs included), widened exactly to fp32."""
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _oracle_bytes(x: np.ndarray, dt: Fp8Dtype) -> np.ndarray:
    """ml_dtypes RNE cast after a saturating clamp (np.clip keeps NaN)."""
    return np.clip(x.astype(np.float32), -dt.max, dt.max).astype(FP8[dt.name]).view(np.uint8)


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_properties_match_ml_dtypes(dt):
    info = ml_dtypes.finfo(FP8[dt.name])
    assert dt.max == float(info.max)
    assert torch.finfo(dt.torch_dtype).max == dt.max
    assert Fp8Dtype.from_torch(dt.torch_dtype) is dt


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_all_256_codes_decode_like_ml_dtypes(dt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = codes.view(dt.torch_dtype).float().numpy()
    ref = codes.numpy().view(FP8[dt.name]).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)  # NaN == NaN here


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_every_code_value_casts_back_to_its_code(dt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(dt.torch_dtype).float()
    keep = torch.isfinite(vals)
    back = _bytes(fp8_cast(vals[keep], dt))
    want = codes[keep].numpy()
    if dt is Fp8Dtype.E4M3FNUZ:
        assert 0x80 not in want  # 0x80 is NaN there
    np.testing.assert_array_equal(back, want)


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_all_bf16_inputs_bit_exact(dt):
    x = _all_bf16_as_fp32()
    ours = _bytes(fp8_cast(x, dt))
    ref = _oracle_bytes(x.numpy(), dt)
    nan = np.isnan(x.numpy())
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    # NaN stays NaN (fnuz has the single NaN 0x80)
    assert torch.isnan(fp8_cast(x[torch.from_numpy(nan)], dt).float()).all()
    # bf16 input gives the same bytes as its fp32 widening (NaN sign/payload is not meaningful)
    np.testing.assert_array_equal(_bytes(fp8_cast(x.bfloat16(), dt))[~nan], ours[~nan])


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_midpoints_round_to_even(dt):
    """Exact fp32 midpoints of neighbouring codes (and one ulp either side): RNE, bit-exact vs ml_dtypes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    vals = codes.view(dt.torch_dtype).double()
    vals = torch.unique(vals[torch.isfinite(vals)])  # sorted
    mid = ((vals[1:] + vals[:-1]) / 2).float()  # exact: neighbours differ by a power of two
    x = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    np.testing.assert_array_equal(_bytes(fp8_cast(x, dt)), _oracle_bytes(x.numpy(), dt))
    # at a tie the result has an even mantissa (code LSB 0)
    assert (_bytes(fp8_cast(mid[mid.abs() > 0], dt)) & 1 == 0).all()


@pytest.mark.parametrize("dt", ALL, ids=lambda d: d.name)
def test_saturates_whatever_torch_does(dt):
    big = torch.tensor([dt.max * 1.04, dt.max * 4, 1e30, float("inf")])
    out = fp8_cast(torch.cat([big, -big]), dt).float()
    assert out.tolist() == [dt.max] * 4 + [-dt.max] * 4


@pytest.mark.parametrize("seed", [0, 1])
def test_random_fp32_bit_exact(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(200_000, generator=g) * torch.exp2(
        torch.randint(-24, 20, (200_000,), generator=g).float()
    )
    for dt in ALL:
        np.testing.assert_array_equal(_bytes(fp8_cast(x, dt)), _oracle_bytes(x.numpy(), dt))
