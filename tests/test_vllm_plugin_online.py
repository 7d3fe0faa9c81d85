"""The plugin's ``"quantization": "online"``: targets get vLLM's meaning (the kv_b_proj linear quantized
online, emulated as mlaq's engine does): the layer's kv_b_proj weight becomes the online dequantized weight
before vLLM's own ``process_weights_after_loading`` splits W_UK / W_UV from it, and the BMMs stay vLLM's."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from mlaq.bundled import bundled_model_dir
from mlaq.integrations.vllm.config import read_config
from mlaq.integrations.vllm.hooks import _apply_online
from mlaq.integrations.vllm.plan import Kernels, checkpoint_files, make_plan
from mlaq.model.loading.online import online_dequantized
from mlaq.settings import Platform, VllmPluginEnv

ONLINE = {"mode": "emulate", "quantization": "online", "targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}


@pytest.fixture
def vllm_tp1(monkeypatch):
    """A stand-in ``vllm.distributed`` at tensor-parallel size 1 (what the online hook asks vLLM)."""
    fake = types.ModuleType("vllm.distributed")
    fake.get_tensor_model_parallel_world_size = lambda: 1
    fake.get_tp_group = None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.distributed", fake)


def test_config_and_plan_give_vllms_meaning():
    config = read_config({"mlaq": ONLINE}, None)
    assert config.explicit.online
    plan = make_plan(
        config,
        checkpoint_files(str(bundled_model_dir()), {}),
        VllmPluginEnv(),
        Kernels(Platform.CPU, False, False),
    )
    assert {(a.online, a.emulate) for a in plan.actions} == {("fp8_per_tensor", None)}
    assert any(
        "quantize the kv_b_proj linear to fp8_per_tensor as vLLM 0.32 does" in line for line in plan.lines()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization": "offline"}, "expected 'online'"),
        ({"targets": {"re:.*kv_b_proj": "mxfp4_w4a16"}}, "is not a vLLM online shorthand"),
        ({"mode": "policy"}, "in mode emulate only"),
        ({"precision": "consistent"}, "with quantization online prefill runs vLLM's online kv_b_proj linear"),
        ({"precision": "absorbed"}, "with quantization online prefill runs vLLM's online kv_b_proj linear"),
    ],
)
def test_bad_online_settings_name_the_key(change, message):
    with pytest.raises(ValueError, match=message):
        read_config({"mlaq": {**ONLINE, **change}}, None)


def test_layer_weight_is_the_online_dequantized_one_before_vllm_splits_it(vllm_tp1):
    """A stand-in layer at tensor-parallel size 1: vLLM's process sees the dequantized weight."""
    g = torch.Generator().manual_seed(9)
    w = (torch.randn(64, 32, generator=g) * 0.1).bfloat16()
    seen = []
    layer = SimpleNamespace(
        layer_name="model.layers.0.self_attn.attn",
        kv_b_proj=SimpleNamespace(weight=torch.nn.Parameter(w.clone(), requires_grad=False)),
    )
    layer.process_weights_after_loading = lambda dtype: seen.append(layer.kv_b_proj.weight.detach().clone())
    _apply_online(layer, "fp8_per_tensor")
    layer.process_weights_after_loading(torch.bfloat16)
    assert len(seen) == 1 and torch.equal(seen[0], online_dequantized(w, "fp8_per_tensor", torch.bfloat16))
    assert not torch.equal(seen[0], w)


@pytest.mark.parametrize("scheme", ["fp8_per_tensor", "fp8_per_channel", "mxfp4", "mxfp8"])
def test_prefill_gemm_is_the_online_linear(vllm_tp1, scheme):
    """vLLM's prefill GEMM (kv_b_proj.quant_method.apply) becomes the online linear: for fp8_per_tensor the
    latent is quantized per token first, so it differs from the dequantized weight's plain product."""
    from mlaq.bmm.online_linear import SCHEMES, OnlineLinear, quantize_weight

    g = torch.Generator().manual_seed(4)
    w = (torch.randn(64, 64, generator=g) * 0.1).bfloat16()
    method = SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.t())
    kv_b = SimpleNamespace(weight=torch.nn.Parameter(w.clone(), requires_grad=False), quant_method=method)
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn", kv_b_proj=kv_b)
    layer.process_weights_after_loading = lambda dtype: None
    _apply_online(layer, scheme)
    layer.process_weights_after_loading(torch.bfloat16)
    x = (torch.randn(5, 64, generator=g)).bfloat16()
    got = kv_b.quant_method.apply(kv_b, x)
    want = OnlineLinear(quantize_weight(w, scheme), SCHEMES[scheme])(x)
    assert torch.equal(got, want)
    assert torch.equal(kv_b.weight, online_dequantized(w, scheme, torch.bfloat16))
    if scheme.startswith("fp8"):  # the activation quantization is in it
        assert not torch.equal(got, (x.double() @ kv_b.weight.double().t()).float().bfloat16())


def test_unpinned_online_schemes_are_refused_at_start_up():
    with pytest.raises(ValueError, match=r"fp8_per_block: vLLM 0.32 splits W_UK / W_UV"):
        read_config({"mlaq": {**ONLINE, "targets": {"re:.*kv_b_proj": "fp8_per_block"}}}, None)
