"""A checkpoint's per-tensor / per-channel FP8 kv_b_proj used as stored, never re-quantized.

``prepare_quantized`` of the AITER schemes keeps the codes' bytes and the scales at exactly the
granularity the kernel's epilogue applies; ``split_kv_b_proj_fp8_scaled`` maps kv_b_proj's per-OUTPUT-ROW
scales onto W_UV^T's M columns (fp8_per_channel) and W_UK's K rows (only fp8_per_block's per-segment
scaling runs those). Oracles: ml_dtypes decoding of the bytes, numpy float64, the vLLM/AITER and
DeepSeek arithmetic of test_bmm_fp8 written element by element.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mlaq.bmm import Fp8PerBlock, get_scheme, split_kv_b_proj_fp8_scaled
from mlaq.formats import Fp8Dtype, Fp8Tensor
from test_bmm_fp8 import (
    NP_FP8,
    _assert_close_bits,
    _data,
    _to_bf16_out,
    oracle_aiter_act,
    oracle_deepseek_quant,
)

GEOMETRY = {"deepseek_v3": (3, 128, 128), "glm5": (3, 192, 256)}  # (heads, P, V)
L = 64
AITER = ["fp8_per_tensor", "fp8_per_head", "fp8_per_channel", "fp8_per_channel_fnuz"]


def _granularity(name: str, n: int, m: int) -> tuple[int, int, int]:
    return {"fp8_per_tensor": (1, 1, 1), "fp8_per_head": (n, 1, 1), "fp8_per_channel": (n, 1, m)}[
        name.removesuffix("_fnuz")
    ]


def _codes(shape: tuple[int, ...], dtype: Fp8Dtype, seed: int) -> torch.Tensor:
    """Every byte value but NaN, uniformly (subnormals and the largest codes included)."""
    raw = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    nan = (raw & 0x7F) == 0x7F if dtype is Fp8Dtype.E4M3FN else raw == 0x80
    return torch.where(nan, torch.zeros_like(raw), raw).view(dtype.torch_dtype)


def _scales(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Positive fp32 scales with full 24-bit significands: code * scale is often not an fp32."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=g) + 0.5) * torch.exp2(torch.randint(-12, -4, shape, generator=g))


def _decode(codes: torch.Tensor) -> np.ndarray:
    """The codes' real values from their bytes, by ml_dtypes (not torch's fp8 conversion)."""
    dtype = Fp8Dtype.from_torch(codes.dtype)
    return codes.view(torch.uint8).numpy().view(NP_FP8[dtype]).astype(np.float64)


@pytest.mark.parametrize("name", AITER)
def test_prepare_quantized_keeps_codes_and_scales_exactly(name):
    scheme = get_scheme(name)
    n, k, m = 3, 200, 40  # ragged K: 200 = 128 + 72
    codes, scale = _codes((n, k, m), scheme.dtype, seed=1), _scales(_granularity(name, n, m), seed=2)
    w = scheme.prepare_quantized(codes, scale)
    exact = _decode(codes) * scale.double().numpy()
    assert not np.array_equal(exact.astype(np.float32).astype(np.float64), exact)  # float64 is needed
    np.testing.assert_array_equal(w.dequantize(torch.float64).numpy(), exact)
    assert torch.equal(w.codes.view(torch.uint8), codes.view(torch.uint8))  # the bytes, not re-derived
    assert w.storage_bytes() == n * k * m + 4 * scale.numel()
    # the kernel: per-group code dots x activation scale in fp32, then the epilogue weight scale
    x, _ = _data(n, 5, k, 1, seed=3)
    xc, xs = oracle_aiter_act(x.float().numpy(), scheme.dtype)
    y64 = np.einsum("nbk,nkm->nbm", xc * xs, _decode(codes)) * scale.numpy()
    _assert_close_bits(scheme.apply(x, w), _to_bf16_out(y64))


@pytest.mark.parametrize("name", AITER)
def test_prepare_quantized_of_prepared_codes_runs_identically(name):
    """A second formulation: what ``prepare`` computes, stored and read back, is the same weight."""
    scheme = get_scheme(name)
    x, w = _data(4, 3, 192, 24, seed=4)
    prepared = scheme.prepare(w)
    scale = prepared.scale.reshape(()) if name == "fp8_per_tensor" else prepared.scale  # a stored scalar
    again = scheme.prepare_quantized(prepared.codes, scale)
    assert torch.equal(again.dequantize(torch.float64), prepared.dequantize(torch.float64))
    assert torch.equal(scheme.apply(x, again), scheme.apply(x, prepared))


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("fp8_per_tensor", (2, 1, 1)),  # one scale per head is not one scale
        ("fp8_per_head", (1, 1, 1)),  # coarser: expand it first
        ("fp8_per_head", (2, 1, 8)),
        ("fp8_per_channel", (2, 1, 1)),
        ("fp8_per_channel", (1, 1, 8)),
        ("fp8_per_channel", (2, 16, 1)),  # varies along K: the epilogue cannot apply it
        ("fp8_per_channel", (2, 16, 8)),
    ],
)
def test_prepare_quantized_rejects_another_granularity(name, shape):
    codes = torch.zeros(2, 16, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"{name}: scale of shape .* does not fit codes \(2, 16, 8\)"):
        get_scheme(name).prepare_quantized(codes, torch.ones(shape))


def test_prepare_quantized_rejects_bad_codes_and_scales():
    scheme = get_scheme("fp8_per_channel")
    codes, ones = torch.zeros(2, 16, 8).to(torch.float8_e4m3fn), torch.ones(2, 1, 8)
    with pytest.raises(ValueError, match=r"codes must be torch.float8_e4m3fn of shape \(N, K, M\)"):
        scheme.prepare_quantized(codes.float(), ones)
    with pytest.raises(ValueError, match="e4m3fn_to_e4m3fnuz"):
        get_scheme("fp8_per_channel_fnuz").prepare_quantized(codes, ones)
    nan = codes.view(torch.uint8).clone()
    nan[0, 0, 0] = 0x7F
    with pytest.raises(ValueError, match="codes hold NaN"):
        scheme.prepare_quantized(nan.view(torch.float8_e4m3fn), ones)
    with pytest.raises(ValueError, match="scale must be fp32"):
        scheme.prepare_quantized(codes, ones.double())
    with pytest.raises(ValueError, match="non-finite or negative"):
        scheme.prepare_quantized(codes, -ones)


def _kv_b_proj(n: int, p: int, v: int, per_channel: bool) -> tuple[Fp8Tensor, np.ndarray, np.ndarray]:
    """A stored kv_b_proj [N*(P+V), L] and its exact W_UK (N, P, L), W_UV^T (N, L, V), split in numpy."""
    rows = n * (p + v)
    codes = _codes((rows, L), Fp8Dtype.E4M3FN, seed=5)
    scale = _scales((rows, 1) if per_channel else (1, 1), seed=6)
    stored = Fp8Tensor(codes, scale, (1, None) if per_channel else (None, None), Fp8Dtype.E4M3FN)
    full = _decode(codes) * scale.double().numpy()  # [rows, L]
    uk = np.stack([full[h * (p + v) : h * (p + v) + p] for h in range(n)])
    uv = np.stack([full[h * (p + v) + p : (h + 1) * (p + v)].T for h in range(n)])
    return stored, uk, uv


@pytest.mark.parametrize("geometry", sorted(GEOMETRY))
def test_per_tensor_kv_b_proj_runs_as_stored(geometry):
    n, p, v = GEOMETRY[geometry]
    stored, uk_exact, uv_exact = _kv_b_proj(n, p, v, per_channel=False)
    (uk_c, uk_s), (uv_c, uv_s) = split_kv_b_proj_fp8_scaled(stored, n, p, v)
    assert uk_s.shape == uv_s.shape == (1, 1, 1)
    scheme = get_scheme("fp8_per_tensor")
    uk, uv = scheme.prepare_quantized(uk_c, uk_s), scheme.prepare_quantized(uv_c, uv_s)
    np.testing.assert_array_equal(uk.dequantize(torch.float64).numpy(), uk_exact)
    np.testing.assert_array_equal(uv.dequantize(torch.float64).numpy(), uv_exact)


@pytest.mark.parametrize("geometry", sorted(GEOMETRY))
def test_per_channel_kv_b_proj_runs_as_stored(geometry):
    """Per output row of kv_b_proj: per M column of W_UV^T (fp8_per_channel), per K row of W_UK."""
    n, p, v = GEOMETRY[geometry]
    stored, uk_exact, uv_exact = _kv_b_proj(n, p, v, per_channel=True)
    (uk_c, uk_s), (uv_c, uv_s) = split_kv_b_proj_fp8_scaled(stored, n, p, v)
    assert (uk_s.shape, uv_s.shape) == ((n, p, 1), (n, 1, v))
    uv = get_scheme("fp8_per_channel").prepare_quantized(uv_c, uv_s)
    np.testing.assert_array_equal(uv.dequantize(torch.float64).numpy(), uv_exact)
    with pytest.raises(ValueError, match="does not fit"):  # W_UK's scales vary along its K
        get_scheme("fp8_per_channel").prepare_quantized(uk_c, uk_s)
    uk = Fp8PerBlock().prepare_quantized(uk_c, uk_s)
    np.testing.assert_array_equal(uk.dequantize(torch.float64).numpy(), uk_exact)
    assert uk.k_bounds == tuple(range(p + 1))  # one K segment per row
    assert uk.storage_bytes() == n * p * L + 4 * n * p  # one fp32 scale per row, not per element
    # q absorption: 1x128 activation groups, each K row's code product times its own scale
    x, _ = _data(n, 4, p, 1, seed=7)
    xc, xs = oracle_deepseek_quant(x.float().numpy(), Fp8Dtype.E4M3FN, (1, 1, 128))
    _assert_close_bits(Fp8PerBlock().apply(x, uk), _to_bf16_out(np.einsum("nbk,nkm->nbm", xc * xs, uk_exact)))


def test_split_rejects_block_fp8():
    t = Fp8Tensor(torch.zeros(512, L).to(torch.float8_e4m3fn), torch.ones(4, 1), (128, 128), Fp8Dtype.E4M3FN)
    with pytest.raises(ValueError, match=r"per-tensor or per-output-row.*split_kv_b_proj_fp8"):
        split_kv_b_proj_fp8_scaled(t, 2, 128, 128)
