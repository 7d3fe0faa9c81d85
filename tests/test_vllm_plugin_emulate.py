"""Emulation mode's weights: ``torch.bmm(x, weight, out=o)`` is mlaq's scheme bit for bit, the ops stay
on the activations' device (checked on ``meta``: no op may produce a tensor elsewhere), and the
consistent prefill weight is the one mlaq's engine decompresses with."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mlaq.bmm import get_scheme, scheme_names
from mlaq.integrations.vllm.emulate import EmulatedBmmWeight, consistent_kv_b, emulated
from mlaq.model.layers.mla import MLAConfig, MLAttention, Precision

# the two Hopper tensor-core emulations build their step grid on the CPU: not offered on other devices
DEVICE_SCHEMES = [s for s in scheme_names() if not s.endswith("_sm90")]


def _move(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: _move(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


class _OffDevice(TorchDispatchMode):
    """Records every op whose output is not on ``meta``."""

    def __init__(self):
        super().__init__()
        self.off = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.device.type != "meta":
                self.off.append(f"{func} -> {o.device}")
        return out


@pytest.mark.parametrize(
    "name", ["bf16", "fp8_per_tensor", "fp8_per_tensor_fnuz", "mxfp4", "fp8_per_block", "mxfp8"]
)
def test_bmm_with_out_is_the_scheme_bit_for_bit(name):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 160, 48, generator=g).bfloat16()  # (N, K, M): K ragged against 32 and 128
    x = torch.randn(4, 5, 160, generator=g).bfloat16() * 3
    weight = emulated(get_scheme(name), w, "test W_UK_T")
    out = torch.empty(5, 4, 48, dtype=torch.bfloat16).transpose(0, 1)  # vLLM writes into a (B, N, L) buffer
    torch.bmm(x, weight, out=out)
    want = get_scheme(name).apply(x, get_scheme(name).prepare(w))
    assert torch.equal(out.float(), want)
    assert torch.equal(torch.bmm(x, weight).float(), want)
    assert weight.shape == (4, 160, 48)


def test_other_ops_are_refused_by_name():
    weight = emulated(get_scheme("mxfp4"), torch.randn(2, 64, 32), "w")
    with pytest.raises(TypeError, match=r"supports only torch\.bmm.*called matmul"):
        torch.matmul(torch.randn(2, 3, 64), weight)


@pytest.mark.parametrize("name", DEVICE_SCHEMES)
def test_apply_stays_on_the_activations_device(name):
    scheme = get_scheme(name)
    prepared = _move(scheme.prepare(torch.randn(4, 160, 64)), "meta")
    weight = EmulatedBmmWeight(scheme, prepared, "w")
    out = torch.empty(4, 3, 64, dtype=torch.bfloat16, device="meta")
    with _OffDevice() as rec:
        torch.bmm(torch.randn(4, 3, 160, device="meta", dtype=torch.bfloat16), weight, out=out)
    assert rec.off == []


@pytest.mark.parametrize("name", ["fp8_per_tensor", "mxfp4"])
def test_consistent_kv_b_is_mlaqs_prefill_weight(name):
    cfg = MLAConfig(
        hidden_size=64,
        num_heads=2,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
    )
    torch.manual_seed(0)
    attn = MLAttention(cfg, dtype=torch.bfloat16)
    attn.prepare(name, Precision.CONSISTENT)
    kv_b = attn.kv_b_proj.weight.detach().view(2, 64, 64)  # (N, P+V, L)
    w_uk, w_uv_t = kv_b[:, :32], kv_b[:, 32:].transpose(1, 2)
    scheme = get_scheme(name)
    got = consistent_kv_b(emulated(scheme, w_uk, "uk"), emulated(scheme, w_uv_t, "uv"), torch.bfloat16)
    assert torch.equal(got, attn.naive_kv_b())
