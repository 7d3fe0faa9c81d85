"""The blocked FP8 quantizer, DeepSeek-V3 checkpoints, and the e4m3fn -> e4m3fnuz conversion."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mlaq.formats import (
    Fp8Dtype,
    Fp8Tensor,
    e4m3fn_to_e4m3fnuz,
    quantize_fp8,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from test_formats_oracle import fp8_block_oracle

BLOCKS = [
    ((3, 300, 200), (None, None, None)),  # per-tensor over all heads
    ((3, 300, 200), (1, None, None)),  # per-head
    ((3, 300, 200), (None, None, 1)),  # per-channel on the last axis
    ((3, 64, 192), (1, 1, 128)),  # per-token-group 128, K=192 -> 128 + 64
    ((5, 100), (1, 48)),  # group 48, ragged tail of 4
    ((2, 300, 200), (1, 128, 128)),  # DeepSeek blocks with ragged edges
    ((300, 200), (128, 128)),
    ((7, 9), (4, None)),
]


def _data(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(
        torch.randint(-8, 8, shape[:1], generator=g).float()
    ).view(-1, *[1] * (len(shape) - 1))
    x.view(-1)[:50] = 0.0
    return x


@pytest.mark.parametrize("dt", list(Fp8Dtype), ids=lambda d: d.name)
@pytest.mark.parametrize(("shape", "block"), BLOCKS, ids=[str(b) for _, b in BLOCKS])
def test_blocked_quantizer_matches_loop_oracle(shape, block, dt):
    x = _data(shape)
    q = quantize_fp8(x, dt, block)
    scale, codes = fp8_block_oracle(x.numpy(), dt.name, block)
    assert q.scale.dtype == torch.float32 and q.codes.dtype == dt.torch_dtype
    np.testing.assert_array_equal(q.scale.numpy().view(np.uint32), scale.view(np.uint32))
    np.testing.assert_array_equal(q.codes.view(torch.uint8).numpy(), codes)
    deq = (q.codes.double() * q.expanded_scale().double()).float()  # round once from the exact product
    assert torch.equal(q.dequantize(), deq)


def test_convenience_wrappers_are_block_specs():
    x = _data((4, 130, 257))
    d = Fp8Dtype.E4M3FN
    assert quantize_fp8_per_tensor(x, d).scale.shape == (1, 1, 1)
    assert quantize_fp8_per_channel(x, d, axis=0).scale.shape == (4, 1, 1)
    assert quantize_fp8_per_channel(x, d, axis=-1).scale.shape == (1, 1, 257)
    assert quantize_fp8_per_token_group(x, d).scale.shape == (4, 130, 3)
    assert quantize_fp8_per_block(x, d).scale.shape == (4, 2, 3)
    a = quantize_fp8_per_token_group(x, d, group_size=64)
    b = quantize_fp8(x, d, (1, 1, 64))
    assert torch.equal(a.scale, b.scale) and torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8))


def test_amax_element_lands_on_max_code():
    x = _data((16, 256))
    q = quantize_fp8_per_token_group(x, Fp8Dtype.E4M3FN)
    top = q.codes.float().abs().view(16, 2, 128).amax(-1)
    assert (top == 448.0).all()


def test_zero_block_convention_and_amax_floor():
    x = torch.zeros(2, 256)
    x[1] = 1.0
    q = quantize_fp8_per_token_group(x, Fp8Dtype.E4M3FN)
    assert q.scale[0].tolist() == [1.0, 1.0]  # AITER pertoken_quant: zero scale replaced by 1
    assert (q.codes[0].float() == 0).all() and (q.dequantize()[0] == 0).all()
    # vLLM CUDA floors the scale at 1/(448*512) == flooring amax at 1/512, in fp32
    v = quantize_fp8(x, Fp8Dtype.E4M3FN, (1, 128), amax_floor=1 / 512)
    assert v.scale[0, 0].item() == torch.tensor(1 / (448 * 512), dtype=torch.float32).item()
    # vLLM Triton eps = 1e-10 on amax
    t = quantize_fp8(x, Fp8Dtype.E4M3FN, (1, 128), amax_floor=1e-10)
    assert t.scale[0, 0] == torch.tensor(1e-10) / 448
    assert torch.equal(t.scale[1], q.scale[1])  # floors leave ordinary blocks alone


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_poisons_its_block_only(bad):
    x = torch.randn(2, 256)
    x[1, 3] = bad
    d = quantize_fp8_per_token_group(x, Fp8Dtype.E4M3FN).dequantize()
    assert torch.isnan(d[1, :128]).all()
    assert torch.isfinite(d[0]).all() and torch.isfinite(d[1, 128:]).all()


def test_deepseek_checkpoint_round_trip_ragged(tmp_path):
    """A 300x200 weight stored as DeepSeek-V3 does (fp8 + fp32 weight_scale_inv [3, 2]), via safetensors."""
    w = _data((300, 200), seed=4)
    q = quantize_fp8_per_block(w, Fp8Dtype.E4M3FN)
    assert q.scale.shape == (3, 2)
    path = tmp_path / "layer.safetensors"
    save_file({"weight": q.codes, "weight_scale_inv": q.scale}, str(path))
    t = load_file(str(path))
    r = Fp8Tensor.from_checkpoint(t["weight"], t["weight_scale_inv"])
    assert torch.equal(r.dequantize(), q.dequantize())
    # dequant = q * scale_inv block-wise, as DeepSeek's weight_dequant does in fp32
    s = q.scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :200]
    assert torch.equal(r.dequantize(), q.codes.float() * s)
    # the ragged corner block (rows 256..299, cols 128..199) has its own amax
    assert q.scale[2, 1] == w[256:, 128:].abs().max() / 448


def test_from_checkpoint_rejects_bad_input():
    q = quantize_fp8_per_block(torch.randn(300, 200), Fp8Dtype.E4M3FN)
    with pytest.raises(ValueError, match=r"\(3, 2\)"):
        Fp8Tensor.from_checkpoint(q.codes, q.scale[:2])
    nan = q.codes.view(torch.uint8).clone()
    nan[0, 0] = 0x7F
    with pytest.raises(ValueError, match="NaN"):
        Fp8Tensor.from_checkpoint(nan.view(torch.float8_e4m3fn), q.scale)
    bad = q.scale.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        Fp8Tensor.from_checkpoint(q.codes, bad)
    with pytest.raises(ValueError, match="not an FP8 dtype"):
        Fp8Tensor.from_checkpoint(q.codes.view(torch.uint8), q.scale)


def test_e4m3fn_to_fnuz_exact_for_every_finite_code():
    raw = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.int32).to(torch.uint8)
    codes = raw.view(torch.float8_e4m3fn).reshape(-1, 1).expand(-1, 3).contiguous()  # (254, 3)
    scale = torch.tensor([[1.0, 3.0e-5, 7.25e3]])  # one scale per column, as per-channel
    t = Fp8Tensor(codes=codes, scale=scale, block=(None, 1), dtype=Fp8Dtype.E4M3FN)
    z = e4m3fn_to_e4m3fnuz(t)
    assert z.dtype is Fp8Dtype.E4M3FNUZ and torch.equal(z.scale, scale * 2)
    assert torch.equal(z.dequantize(), t.dequantize())  # exact, -0 becomes +0
    zb = z.codes.view(torch.uint8)
    assert (zb != 0x80).all() and zb[raw == 0x80].eq(0).all()
    assert not torch.isnan(z.dequantize()).any()
    nan = Fp8Tensor(
        codes=raw[:1].clone().fill_(0x7F).view(torch.float8_e4m3fn),
        scale=torch.ones(1),
        block=(None,),
        dtype=Fp8Dtype.E4M3FN,
    )
    with pytest.raises(ValueError, match="NaN"):
        e4m3fn_to_e4m3fnuz(nan)


def test_block_spec_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one entry per dim"):
        quantize_fp8(x, Fp8Dtype.E4M3FN, (1,))
    with pytest.raises(ValueError, match="positive ints or None"):
        quantize_fp8(x, Fp8Dtype.E4M3FN, (1, 0))
    with pytest.raises(ValueError, match="0-d"):
        quantize_fp8(torch.tensor(1.0), Fp8Dtype.E4M3FN, ())
    with pytest.raises(ValueError, match="amax_floor"):
        quantize_fp8(x, Fp8Dtype.E4M3FN, (1, None), amax_floor=-1.0)
    with pytest.raises(ValueError, match="out of range"):
        quantize_fp8_per_channel(x, Fp8Dtype.E4M3FN, axis=2)
