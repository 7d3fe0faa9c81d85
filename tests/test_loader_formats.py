"""Quantized checkpoints in their real on-disk formats load to exactly what was quantized.

The writers in model_helpers quantize independently of mlaq (ml_dtypes casts); every quantized linear
must load bit-identical to codes x scales, kv_b_proj must reach its BMM scheme as the policy decided
(the checkpoint's own FP8 block codes/scales under rule ``checkpoint``), and prefill logits must match
transformers run on the same dequantized weights.
"""

from __future__ import annotations

import re

import pytest
import torch

from mlaq.bmm.kv_b import split_kv_b_proj
from mlaq.model import load_model
from mlaq.settings import Settings
from model_helpers import add_mtp_layer, decode_vs_prefill, hf_checkpoint
from quant_helpers import quantize_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def _assert_loaded_exactly(model, expected: dict[str, torch.Tensor]) -> None:
    state = _weights(model)
    assert expected, "the writer quantized nothing"
    for name, value in expected.items():
        assert torch.equal(state[name], value), f"{name} does not dequantize to what was quantized"


def _prefill_matches_transformers(hf, model, expected) -> None:
    """transformers with the dequantized weights is the oracle for the naive path."""
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, value in expected.items():
            m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
            if m is None or f"{m.group(1)}.down_proj" not in params:
                if name in params:  # (MTP layers are not part of transformers' model)
                    params[name].copy_(value)
                continue
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            if kind == "down":  # transformers fuses experts: down_proj (E, H, I), gate_up_proj (E, 2I, H)
                params[f"{prefix}.down_proj"][e].copy_(value)
            else:
                rows = value.shape[0]
                part = slice(0, rows) if kind == "gate" else slice(rows, 2 * rows)
                params[f"{prefix}.gate_up_proj"][e, part].copy_(value)
    ids = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = hf(ids).logits
    out = model.prefill(ids).logits
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-4


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite"])
def test_fp8_block_checkpoint(model_type, tmp_path):
    hf, path = hf_checkpoint(model_type, tmp_path)
    add_mtp_layer(hf, path)  # DeepSeek-V3 stores its MTP layer in FP8 too
    expected = quantize_checkpoint(path, "fp8")
    model = load_model(path, settings=OFF)
    _assert_loaded_exactly(model, expected)
    n_layers = hf.config.num_hidden_layers + 1
    assert [(d.scheme, d.rule.value) for d in model.bmm_decisions] == [
        ("fp8_per_block", "checkpoint")
    ] * n_layers
    # the absorbed BMMs run the checkpoint's own codes and scales: exactly W_UK / W_UV^T of kv_b_proj
    cfg = model.mla_config
    for i in range(n_layers):
        kv_b = expected[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        w_uk, w_uv = split_kv_b_proj(kv_b, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
        absorbed = model.model.layers[i].self_attn.absorbed
        assert torch.equal(absorbed.w_uk.dequantize(), w_uk)
        assert torch.equal(absorbed.w_uv.dequantize(), w_uv)
    _prefill_matches_transformers(hf, model, expected)
    # decode runs fp8_per_block (1x128 FP8 activations): near, but not equal to, the naive path
    rel = decode_vs_prefill(model)
    assert 0 < rel < 0.2, rel  # a sanity bound: FP8 activations cost a few % per BMM


def test_quark_mxfp4_checkpoint(tmp_path):
    """Quark MXFP4 as AMD exports DeepSeek: experts/MLPs in MXFP4, self_attn excluded (kept fp32 here)."""
    hf, path = hf_checkpoint("deepseek_v3", tmp_path, q_lora_rank=64)
    expected = quantize_checkpoint(path, "quark_mxfp4", skip=("self_attn",))
    assert any(".experts." in k for k in expected)
    model = load_model(path, settings=OFF)
    _assert_loaded_exactly(model, expected)
    assert {(d.source, d.scheme, d.rule.value) for d in model.bmm_decisions} == {("fp32", "fp32", "default")}
    _prefill_matches_transformers(hf, model, expected)


def test_quark_mxfp4_kv_b_proj_keeps_stored_w_uv(tmp_path):
    """A Quark checkpoint that stores kv_b_proj in MXFP4: rule checkpoint; W_UV^T (blocks along L, the
    BMM's K) keeps the stored codes and scales; W_UK is regrouped along P from the exact weight."""
    _, path = hf_checkpoint("deepseek_v3", tmp_path, q_lora_rank=64)
    expected = quantize_checkpoint(path, "quark_mxfp4")
    model = load_model(path, settings=OFF)
    _assert_loaded_exactly(model, expected)
    d = model.bmm_decisions[0]
    assert (d.source, d.rule.value) == ("mxfp4", "checkpoint") and d.scheme.startswith("mxfp4")
    cfg = model.mla_config
    kv_b = expected["model.layers.0.self_attn.kv_b_proj.weight"]
    _, w_uv = split_kv_b_proj(kv_b, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
    assert torch.equal(model.model.layers[0].self_attn.absorbed.w_uv.dequantize(), w_uv)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_checkpoint(strategy, tmp_path):
    hf, path = hf_checkpoint("deepseek_v32", tmp_path)
    expected = quantize_checkpoint(path, "compressed-tensors", strategy=strategy, skip=("kv_b_proj",))
    model = load_model(path, settings=OFF)
    _assert_loaded_exactly(model, expected)
    assert {d.rule.value for d in model.bmm_decisions} == {"default"}  # kv_b_proj left unquantized
    _prefill_matches_transformers(hf, model, expected)


def test_bf16_compute_rounds_dequantized_weights_once(tmp_path):
    hf, path = hf_checkpoint("deepseek_v3", tmp_path)
    expected = quantize_checkpoint(path, "fp8")
    model = load_model(path, settings=OFF, dtype=torch.bfloat16)
    state = _weights(model)
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    assert state[name].dtype == torch.bfloat16
    assert torch.equal(state[name], expected[name].to(torch.bfloat16))
    assert state["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    ids = torch.randint(0, hf.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(6))
    assert model.prefill(ids).logits.isfinite().all()


@pytest.mark.parametrize("model_type", ["deepseek_v3", "glm4_moe_lite"])
def test_fp8_block_checkpoint_as_fnuz_target_is_converted_exactly(model_type, tmp_path):
    """AMD gfx942: targets naming the stored scheme's _fnuz variant convert the checkpoint's e4m3fn codes
    as vLLM's normalize_e4m3fn_to_e4m3fnuz does (exact), rather than re-quantizing from dequantized weights."""
    hf, path = hf_checkpoint(model_type, tmp_path)
    expected = quantize_checkpoint(path, "fp8")
    targets = '{"targets": {"re:.*kv_b_proj": "fp8_per_block_fnuz"}}'
    model = load_model(path, settings=OFF, quantization_config=targets)
    decisions = model.bmm_decisions
    assert [(d.scheme, d.rule.value) for d in decisions] == [("fp8_per_block_fnuz", "targets")] * len(
        decisions
    )
    assert all(d.converts_to_fnuz and not d.requantized for d in decisions)
    assert (
        "converted exactly to e4m3fnuz" in decisions[0].reason
        and "re-quantized online" not in decisions[0].reason
    )
    cfg = model.mla_config
    for i in range(hf.config.num_hidden_layers):
        kv_b = expected[f"model.layers.{i}.self_attn.kv_b_proj.weight"]
        w_uk, w_uv = split_kv_b_proj(kv_b, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
        absorbed = model.model.layers[i].self_attn.absorbed
        assert absorbed.w_uk.codes.dtype == torch.float8_e4m3fnuz
        assert torch.equal(absorbed.w_uk.dequantize(), w_uk)
        assert torch.equal(absorbed.w_uv.dequantize(), w_uv)
