"""vLLM 0.32's online linear schemes (mlaq.bmm.online_linear) against an independent re-derivation in numpy /
ml_dtypes, and the engine running them (``--quantization online``: prefill's kv_b_proj linear with its
activation quantization, decode's BMMs on the dequantized weight).

Oracle: scales in numpy float32 with the operation vLLM writes (a CUDA ``tensor / 448.0`` is a multiply by
float32(1/448), a 0-d tensor divisor a true division); codes by ml_dtypes' float8_e4m3fn cast (round to
nearest even) after saturating; MX exponents from exact integer arithmetic on float32 bit patterns; the GEMM
as exact rationals (fractions.Fraction) rounded once to float32. vLLM's own functions are checked against
mlaq in tests/vllm_live/online_formats.py (vLLM's environment).
"""

from __future__ import annotations

import json
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.bmm import scheme_names
from mlaq.bmm.online_linear import (
    Act,
    decode_weight,
    exact_linear,
    near_boundary,
    quantize_activation,
    quantize_weight,
)
from mlaq.bundled import bundled_model_dir
from mlaq.model import load_model
from mlaq.model.layers.mla import AttnPath
from mlaq.model.loading.online import online_kv_b, online_weights
from mlaq.policy import load_explicit

F32 = np.float32


def _weight(o: int = 256, k: int = 512, seed: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(o, k, generator=g) * 0.03).bfloat16()
    w[130:, 300:] = 0  # all-zero blocks (amax floors)
    if o > 5:
        w[5, 7] = 1.75  # a block amax 1.75 * 2^0: amax / 448 is a power of two
    return w


def _e4m3(x: np.ndarray) -> np.ndarray:
    return np.clip(x.astype(F32), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


@pytest.mark.parametrize("cuda", [True, False])
def test_fp8_per_block_weight(cuda):
    w = _weight()
    q = quantize_weight(w, "fp8_per_block", reciprocal_scalar=cuda)
    wn = w.float().numpy()
    for bo in range(2):
        for bk in range(4):
            blk = wn[bo * 128 : (bo + 1) * 128, bk * 128 : (bk + 1) * 128]
            amax = max(F32(np.abs(blk).max()), F32(1e-4))
            sf = F32(amax * F32(1 / 448)) if cuda else F32(amax / F32(448))
            codes = _e4m3(blk * (F32(1) / sf))
            assert q.scales[bo * 128, bk].item() == float(sf)
            assert np.array_equal(
                q.codes[bo * 128 : (bo + 1) * 128, bk * 128 : (bk + 1) * 128].numpy(), codes
            )


def test_fp8_per_channel_weight():
    w = _weight()
    q = quantize_weight(w, "fp8_per_channel")
    wn = w.float().numpy()
    amax = np.abs(wn).max(axis=1, keepdims=True).astype(F32)
    s = np.maximum(amax / F32(448), F32(1) / F32(448 * 512))
    assert np.array_equal(q.scales.numpy(), s.astype(np.float64))
    assert np.array_equal(q.codes.numpy(), _e4m3(wn / s))  # a true division


def test_fp8_per_tensor_weight():
    w = _weight()
    q = quantize_weight(w, "fp8_per_tensor")
    s = F32(np.abs(w.float().numpy()).max()) / F32(448)
    assert q.scales[0, 0].item() == float(s)
    assert np.array_equal(q.codes.numpy(), _e4m3(w.float().numpy() * (F32(1) / s)))


def _ceil_log2(x: F32) -> int:
    m, e = np.frexp(np.float64(x))  # exact: x = m * 2^e, 0.5 <= m < 1
    return int(e - 1) if m == 0.5 else int(e)


@pytest.mark.parametrize("cuda", [True, False])
def test_mxfp8_weight(cuda):
    w = _weight()
    q = quantize_weight(w, "mxfp8", reciprocal_scalar=cuda)
    wn = w.float().numpy().reshape(256, 16, 32)
    for r in (0, 5, 131, 255):
        for b in range(16):
            amax = max(F32(np.abs(wn[r, b]).max()), np.finfo(F32).tiny)
            y = F32(amax * F32(1 / 448)) if cuda else F32(amax / F32(448))
            e = min(max(_ceil_log2(y), -127), 127)
            assert q.scales[r, b].item() == 2.0**e
            assert np.array_equal(q.codes[r, b * 32 : (b + 1) * 32].numpy(), _e4m3(wn[r, b] / F32(2.0**e)))


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def test_mxfp4_weight():
    """OCP MX EVEN scale (amax rounded to E2M1's 1 mantissa bit, half up, on its bits; floor log2; -2) and
    E2M1 round-to-nearest-even, saturating at 6."""
    w = _weight()
    q = quantize_weight(w, "mxfp4")
    wn = w.float().numpy().reshape(256, 16, 32)
    for r in (0, 5, 131):
        for b in range(16):
            bits = int(np.abs(wn[r, b]).max().view(np.uint32)) + 0x200000
            e = min(max(((bits >> 23) & 0xFF) - 127 - 2, -127), 127) if bits >> 23 & 0xFF else -127
            assert q.scales[r, b].item() == 2.0**e
            y = np.abs(wn[r, b]) / 2.0**e
            d = np.abs(y[:, None] - E2M1[None, :])
            best = d.min(axis=1, keepdims=True)
            tie = d == best
            pick = np.where(
                tie[:, ::2].any(axis=1), np.argmax(tie * (np.arange(8) % 2 == 0), axis=1), best.argmin(1)
            )
            pick = np.where(tie.sum(axis=1) > 1, pick, np.argmin(d, axis=1))
            assert np.array_equal(np.abs(q.codes[r, b * 32 : (b + 1) * 32].numpy()), E2M1[pick])


def test_activations_per_token_and_per_group():
    x = _weight(48, 512, seed=9)
    x[3] = 0
    xn = x.float().numpy()
    codes, scales, g = quantize_activation(x, Act.FP8_PER_TOKEN)
    amax = np.abs(xn).max(axis=1, keepdims=True)
    s = np.maximum(amax / F32(448), F32(1.0 / (448 * 512)))
    assert g == 512 and np.array_equal(scales.numpy(), s.astype(np.float64))
    assert np.array_equal(codes.numpy(), _e4m3(xn * (F32(1) / s)))
    codes, scales, g = quantize_activation(x, Act.FP8_PER_GROUP)
    grp = xn.reshape(48, 4, 128)
    s = np.maximum(np.abs(grp).max(axis=2), F32(1e-10)) / F32(448)
    assert g == 128 and np.array_equal(scales.numpy(), s.astype(np.float64))
    assert np.array_equal(codes.numpy(), _e4m3(grp / s[..., None]).reshape(48, 512))


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "mxfp4", "mxfp8"])
def test_exact_linear_rounds_the_exact_sum_once(scheme):
    w = _weight()[:6]
    x = _weight(3, 512, seed=11)
    q = quantize_weight(w, scheme)
    from mlaq.bmm.online_linear import SCHEMES

    act = SCHEMES[scheme]
    y = exact_linear(x, q, act, torch.float32)
    cx, sx, gx = quantize_activation(x, act)
    xd = (cx * sx.repeat_interleave(gx, dim=1)).numpy()
    wd = q.dequantize().numpy()
    for t in range(3):
        for o in range(6):
            if act is Act.FP8_PER_TOKEN:  # CUTLASS: fp32 accumulator, then s_a * (s_w * acc) in fp32
                codes = sum(
                    (Fraction(float(a)) * Fraction(float(b)) for a, b in zip(cx[t], q.codes[o], strict=True)),
                    Fraction(0),
                )
                tmp = F32(F32(q.scales[o, 0].item()) * F32(float(codes)))
                assert y[t, o].item() == float(F32(F32(sx[t, 0].item()) * tmp)), (t, o)
                continue
            exact = sum(
                (Fraction(float(a)) * Fraction(float(b)) for a, b in zip(xd[t], wd[o], strict=True)),
                Fraction(0),
            )
            assert y[t, o].item() == float(F32(float(exact))), (t, o)


def test_tensor_parallel_shards():
    """fp8_per_tensor's amax is the whole weight's on every rank; the others quantize each rank's rows."""
    w = _weight(256, 512)
    whole = quantize_weight(w, "fp8_per_tensor")
    for s in online_weights(w, "fp8_per_tensor", 2):
        assert s.scales[0, 0] == whole.scales[0, 0]
    assert not torch.equal(whole.scales[0, 0], quantize_weight(w[128:], "fp8_per_tensor").scales[0, 0])
    shards = online_weights(w, "mxfp4", 2)
    assert torch.equal(torch.cat([s.codes for s in shards]), quantize_weight(w, "mxfp4").codes)


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_channel", "mxfp4", "mxfp8"])
def test_engine_runs_vllms_meaning(scheme):
    """kv_b_proj (decode's BMM source) is the decoded weight, prefill runs the online linear."""
    path = bundled_model_dir()
    cfg = load_explicit(json.dumps({"targets": {"re:.*kv_b_proj": scheme}}), scheme_names(), online=True)
    model = load_model(path, quantization_config=cfg)
    plain = load_model(path)
    attn, base = model.model.layers[1].self_attn, plain.model.layers[1].self_attn
    prefill, decoded = online_kv_b(base.kv_b_proj.weight, scheme, torch.bfloat16)
    assert torch.equal(attn.kv_b_proj.weight, decoded)
    x = base.kv_b_proj.weight[:4].float().bfloat16()[:, :512]  # any latent rows
    assert torch.equal(attn.kv_b_online(x), prefill(x))
    assert torch.equal(decoded, decode_weight(quantize_weight(base.kv_b_proj.weight, scheme), torch.bfloat16))


def test_prefill_activation_quantization_is_included():
    """fp8_per_tensor on sm90 quantizes c_kv per token: turning that off changes prefill's logits."""
    path = bundled_model_dir()
    cfg = load_explicit('{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}', scheme_names(), online=True)
    model = load_model(path, quantization_config=cfg)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        on = model(ids, path=AttnPath.NAIVE).logits.float()
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_b_online, _ = online_kv_b(
                attn.kv_b_proj.weight, "fp8_per_tensor", torch.bfloat16, act=Act.NONE
            )
        off = model(ids, path=AttnPath.NAIVE).logits.float()
    assert not torch.equal(on, off)
    assert (on - off).abs().mean() < 0.1  # a rounding-sized change, not a different model


def test_fp8_per_channel_decode_weight_is_cutlass_identity_read():
    """vLLM reads fp8_per_channel's W_UK / W_UV as the FP8 GEMM of an identity: the 1.0 quantized per token
    (code 448, scale fp32(1/448)), CUTLASS's epilogue bf16(fp32(s_a * fp32(s_w * acc))). Oracle in numpy
    float32; it differs from bf16(code * s_w) on the weights at a bf16 tie (counted by near_boundary)."""
    w = _weight(64, 512)
    q = quantize_weight(w, "fp8_per_channel")
    got = decode_weight(q, torch.bfloat16).float().numpy()
    s_a = F32(1) / F32(448)
    acc = (q.codes.numpy() * 448).astype(F32)
    want = (s_a * (q.scales.numpy().astype(F32) * acc).astype(F32)).astype(F32)
    assert np.array_equal(got, want.astype(ml_dtypes.bfloat16).astype(np.float32))
    plain = load_model(bundled_model_dir())
    kv = plain.model.layers[0].self_attn.kv_b_proj.weight
    q = quantize_weight(kv, "fp8_per_channel")
    naive = q.dequantize().float().bfloat16()
    assert near_boundary(q) > 0 and not torch.equal(decode_weight(q, torch.bfloat16), naive)


def test_unpinned_decode_weights_are_refused():
    """fp8_per_block: vLLM reads the decode weight through an FP8 GEMM on an identity whose kernel depends
    on the deployment (DeepGEMM, CUTLASS or Triton), and about 1 % of the bundled model's kv_b_proj weights
    sit on a bf16 rounding tie, where that kernel's scale arithmetic decides: refused, not approximated.
    The MX schemes have no such element."""
    plain = load_model(bundled_model_dir())
    w = plain.model.layers[0].self_attn.kv_b_proj.weight
    for scheme in ("fp8_per_block",):
        assert near_boundary(quantize_weight(w, scheme)) > w.numel() // 200
        with pytest.raises(
            ValueError, match=rf"--quantization online {scheme}: vLLM 0.32 splits W_UK / W_UV"
        ):
            load_explicit(json.dumps({"targets": {"re:.*kv_b_proj": scheme}}), scheme_names(), online=True)
        with pytest.raises(ValueError, match=rf"--quantization online {scheme}: vLLM 0.32 splits"):
            online_kv_b(w, scheme, torch.bfloat16)
    assert near_boundary(quantize_weight(w, "mxfp4")) == 0 and near_boundary(quantize_weight(w, "mxfp8")) == 0
