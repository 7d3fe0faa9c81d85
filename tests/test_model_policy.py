"""The policy's kv_b_proj decisions are applied at load and recorded on the model, and agree with
``mlaq explain`` on the same directory."""

from __future__ import annotations

import json

import pytest
import torch

from mlaq.model import ModelCache, Precision, load_model
from mlaq.model.layers.mla import AttnPath
from mlaq.settings import Settings
from model_helpers import add_mtp_layer, edit_config, hf_checkpoint
from quant_helpers import quantize_checkpoint


def _schemes(model) -> list[tuple[str, str]]:
    out = []
    for d in model.bmm_decisions:
        ab = model.model.layers[d.layer].self_attn.absorbed
        assert ab.scheme_uk.name == ab.scheme_uv.name == d.scheme, f"layer {d.layer} runs another scheme"
        out.append((d.scheme, d.rule.value))
    return out


@pytest.fixture
def bf16_ckpt(tmp_path):
    hf, path = hf_checkpoint("deepseek_v3", tmp_path)
    add_mtp_layer(hf, path)
    edit_config(path, torch_dtype="bfloat16")  # a bf16 model (weights cast at load)
    return path


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({}, ("bf16", "default")),
        ({"MLAQ_FP8BMM": "1"}, ("fp8_per_tensor", "flag")),
        ({"MLAQ_FP4BMM": "on", "MLAQ_FP8BMM": "1"}, ("mxfp4", "flag")),  # FP4 wins
    ],
)
def test_flags_apply_to_every_layer_and_match_explain(bf16_ckpt, env, want, mlaq_cli):
    model = load_model(bf16_ckpt, settings=Settings.from_env(env))
    assert model.dtype == torch.bfloat16
    assert _schemes(model) == [want] * 4  # 3 layers + the MTP layer
    explained = mlaq_cli("explain", str(bf16_ckpt), "--json", env=env, check=True)
    shown = json.loads(explained.stdout)
    assert shown.pop("weights_checked") is None  # explain read config files only
    assert shown == model.policy.to_json()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    cache = ModelCache()
    out = model.prefill(ids[:, :-1], cache)
    assert model.decode(ids[:, -1:], cache).logits.isfinite().all()
    assert model.mtp_step(ids[:, 1:], out.hidden, ModelCache()).logits.isfinite().all()


def test_explicit_targets_choose_one_layer(bf16_ckpt):
    targets = '{"targets": {"re:model\\\\.layers\\\\.1\\\\.self_attn\\\\.kv_b_proj": "mxfp8"}}'
    model = load_model(bf16_ckpt, settings=Settings(fp8bmm=False, fp4bmm=False), quantization_config=targets)
    assert _schemes(model) == [
        ("bf16", "default"),
        ("mxfp8", "targets"),
        ("bf16", "default"),
        ("bf16", "default"),
    ]


def test_guard_keeps_an_excluded_kv_b_proj(tmp_path):
    """GLM-style Quark MXFP4 checkpoint excluding self_attn: the FP4 flag does not re-quantize it."""
    _, path = hf_checkpoint("glm_moe_dsa", tmp_path, q_lora_rank=64)
    quantize_checkpoint(path, "quark_mxfp4", skip=("self_attn",))
    edit_config(path, torch_dtype="bfloat16")
    model = load_model(path, settings=Settings(fp8bmm=True, fp4bmm=True))
    assert set(_schemes(model)) == {("bf16", "guard")}


def test_consistent_precision_uses_the_scheme_in_prefill(bf16_ckpt):
    settings = Settings(fp8bmm=False, fp4bmm=True)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    plain = load_model(bf16_ckpt, settings=Settings(fp8bmm=False, fp4bmm=False)).prefill(ids).logits
    decode_only = load_model(bf16_ckpt, settings=settings).prefill(ids).logits
    consistent = load_model(bf16_ckpt, settings=settings, precision=Precision.CONSISTENT).prefill(ids).logits
    assert torch.equal(decode_only, plain)  # vLLM: prefill keeps the checkpoint's kv_b_proj
    assert not torch.equal(consistent, plain)  # CONSISTENT: prefill sees the MXFP4 weights too


def test_absorbed_precision_prefills_as_decode_does(bf16_ckpt):
    """ABSORBED: the whole model's prefill is its absorbed-path (decode) forward over the same tokens,
    bit for bit, scheme BMMs included; CONSISTENT's prefill is not."""
    settings = Settings(fp8bmm=False, fp4bmm=True)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    absorbed = load_model(bf16_ckpt, settings=settings, precision=Precision.ABSORBED)
    decode_path = absorbed(ids, path=AttnPath.ABSORBED).logits
    assert torch.equal(absorbed.prefill(ids).logits, decode_path)
    consistent = load_model(bf16_ckpt, settings=settings, precision=Precision.CONSISTENT)
    assert not torch.equal(consistent.prefill(ids).logits, decode_path)
