"""BMM weights from quantized checkpoints: fp8_per_block keeps a DeepSeek FP8 checkpoint exactly (GLM-5's
head-straddling blocks included); fp8_per_tensor re-quantizes it lossily (what vLLM's FP8 BMM flag
does to FP8 checkpoints); MXFP4 W_UV from a Quark checkpoint is used as stored."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.bmm import Fp8PerBlock, get_scheme, split_kv_b_proj, split_kv_b_proj_fp8, split_kv_b_proj_mx_uv
from mlaq.formats import (
    Fp8Dtype,
    Fp8Tensor,
    MxElem,
    MxTensor,
    ScaleRule,
    e4m3fn_to_e4m3fnuz,
    quantize_fp8,
    quantize_mx,
)

GEOMETRY = {"deepseek_v3": (4, 128, 128), "glm5": (4, 192, 256)}  # (heads reduced from 128/64, P, V)
L = 512


def _checkpoint(n: int, p: int, v: int, seed: int = 0) -> Fp8Tensor:
    """A kv_b_proj [N*(P+V), L] stored as DeepSeek-V3 does: e4m3fn + 128x128 weight_scale_inv."""
    g = torch.Generator().manual_seed(seed)
    rows = n * (p + v)
    w = torch.randn(rows, L, generator=g) * torch.exp(torch.randn(rows, 1, generator=g))  # row spread
    t = quantize_fp8(w.bfloat16().float(), Fp8Dtype.E4M3FN, (128, 128))
    return Fp8Tensor.from_checkpoint(t.codes, t.scale)


def _exact_heads(t: Fp8Tensor, n: int, p: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """Independent per-element dequant in float64 and per-head split: (W_UK (N,P,L), W_UV^T (N,L,V))."""
    codes = t.codes.float().numpy().astype(np.float64)
    s = t.scale.numpy().astype(np.float64)
    full = codes * np.kron(s, np.ones((128, 128)))[: codes.shape[0], : codes.shape[1]]
    uk = np.stack([full[h * (p + v) : h * (p + v) + p] for h in range(n)])
    uv = np.stack([full[h * (p + v) + p : (h + 1) * (p + v)].T for h in range(n)])
    return uk, uv


def _deepseek_reference(x: torch.Tensor, w_exact: np.ndarray) -> np.ndarray:
    """1x128 activation groups (scale = amax/448 fp32, codes = x / scale) times the exact weight."""
    xf = x.float().numpy()
    xq = np.zeros(xf.shape)
    for k0 in range(0, xf.shape[-1], 128):
        xg = xf[..., k0 : k0 + 128]
        s = np.abs(xg).max(axis=-1, keepdims=True) / np.float32(448)
        xq[..., k0 : k0 + 128] = (
            np.clip(xg / s, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * s
        )
    y = np.einsum("nbk,nkm->nbm", xq, w_exact)
    return y.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.parametrize("geometry", sorted(GEOMETRY))
def test_per_block_keeps_checkpoint_exactly(geometry):
    n, p, v = GEOMETRY[geometry]
    t = _checkpoint(n, p, v)
    (uk_c, uk_s), (uv_c, uv_s) = split_kv_b_proj_fp8(t, n, p, v)
    uk_exact, uv_exact = _exact_heads(t, n, p, v)
    scheme = Fp8PerBlock()
    uk, uv = scheme.prepare_quantized(uk_c, uk_s), scheme.prepare_quantized(uv_c, uv_s)
    np.testing.assert_array_equal(uk.dequantize(torch.float64).numpy(), uk_exact)
    np.testing.assert_array_equal(uv.dequantize(torch.float64).numpy(), uv_exact)
    if geometry == "glm5":  # 448 = 3.5 blocks: odd heads start mid-block, so K=P is cut at 64
        assert uk.k_bounds == (0, 64, 128, 192)
    else:
        assert uk.k_bounds == (0, 128) and uv.k_bounds == (0, 128, 256, 384, 512)
    g = torch.Generator().manual_seed(1)
    for prepared, exact, k in ((uk, uk_exact, p), (uv, uv_exact, L)):
        x = torch.randn(n, 5, k, generator=g).bfloat16()
        got = scheme.apply(x, prepared).numpy()
        want = _deepseek_reference(x, exact)
        ulp = np.spacing(np.abs(want).astype(ml_dtypes.bfloat16)).astype(np.float32)
        assert np.all(np.abs(got - want) <= ulp) and np.mean(got == want) > 0.99


def test_per_block_requantizing_glm_is_not_lossless():
    """Why prepare_quantized exists: re-blocking per head (prepare) moves GLM-5's block edges."""
    n, p, v = GEOMETRY["glm5"]
    t = _checkpoint(n, p, v)
    uk_exact, _ = _exact_heads(t, n, p, v)
    requant = Fp8PerBlock().prepare(torch.from_numpy(uk_exact).float()).dequantize(torch.float64).numpy()
    assert np.mean(requant != uk_exact) > 0.05


def test_per_tensor_on_fp8_checkpoint_is_lossy():
    """vLLM's FP8 BMM flag has no source check: it dequantizes the FP8 checkpoint to bf16, then takes
    ONE scale for all heads. Most weights change; fp8_per_block from the checkpoint changes none."""
    n, p, v = GEOMETRY["deepseek_v3"]
    t = _checkpoint(n, p, v)
    uk_exact, _ = _exact_heads(t, n, p, v)
    w_bf16, _ = split_kv_b_proj(t.dequantize().bfloat16().float(), n, p, v)  # get_and_maybe_dequant_weights
    requant = get_scheme("fp8_per_tensor").prepare(w_bf16).dequantize(torch.float64).numpy()
    rel = np.linalg.norm(requant - uk_exact) / np.linalg.norm(uk_exact)
    changed = np.mean(requant != uk_exact)
    assert rel > 0.01 and changed > 0.5, (rel, changed)
    (c, s), _ = split_kv_b_proj_fp8(t, n, p, v)
    kept = Fp8PerBlock().prepare_quantized(c, s).dequantize(torch.float64).numpy()
    assert np.array_equal(kept, uk_exact)


def test_fnuz_checkpoint_conversion_is_exact():
    n, p, v = GEOMETRY["glm5"]
    t = _checkpoint(n, p, v)
    uk_exact, _ = _exact_heads(t, n, p, v)
    scheme = get_scheme("fp8_per_block_fnuz")
    (c, s), _ = split_kv_b_proj_fp8(t, n, p, v)
    with pytest.raises(ValueError, match="e4m3fn_to_e4m3fnuz"):
        scheme.prepare_quantized(c, s)
    (c, s), _ = split_kv_b_proj_fp8(e4m3fn_to_e4m3fnuz(t), n, p, v)
    np.testing.assert_array_equal(scheme.prepare_quantized(c, s).dequantize(torch.float64).numpy(), uk_exact)


def test_prepare_quantized_rejects_bad_scales():
    c = torch.zeros(2, 8, 4).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="does not broadcast"):
        Fp8PerBlock().prepare_quantized(c, torch.ones(3, 8, 4))
    with pytest.raises(ValueError, match="non-finite or negative"):
        Fp8PerBlock().prepare_quantized(c, torch.full((2, 8, 4), float("inf")))


@pytest.mark.parametrize("name", ["mxfp4", "mxfp4_w4a16"])
def test_mxfp4_uv_from_quark_checkpoint(name):
    """A Quark MXFP4 kv_b_proj (fp4x2 weight + E8M0 weight_scale, blocks along L) gives W_UV^T with
    blocks along K = L: used as stored, bit-identical to quantizing the same weight in mlaq."""
    n, p, v = GEOMETRY["glm5"]
    g = torch.Generator().manual_seed(2)
    w = torch.randn(n * (p + v), L, generator=g).bfloat16().float()
    mx = quantize_mx(w, MxElem.E2M1, ScaleRule.EVEN, axis=1)
    stored = MxTensor.from_packed(mx.packed(), mx.scales, MxElem.E2M1, axis=1)  # what Quark writes
    scheme = get_scheme(name)
    from_ckpt = scheme.prepare_quantized(split_kv_b_proj_mx_uv(stored, n, p, v))
    _, uv = split_kv_b_proj(w, n, p, v)
    requant = scheme.prepare(uv)
    assert torch.equal(from_ckpt.dequantize(), requant.dequantize())
    x = torch.randn(n, 3, L, generator=g).bfloat16()
    assert torch.equal(scheme.apply(x, from_ckpt), scheme.apply(x, requant))
    with pytest.raises(ValueError, match="blocks of 32 along K"):
        scheme.prepare_quantized(quantize_mx(uv, MxElem.E2M1, ScaleRule.EVEN, axis=2))
