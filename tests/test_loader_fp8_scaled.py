"""compressed-tensors FP8 checkpoints that quantize kv_b_proj per tensor or per channel keep it exactly.

The policy says rule ``checkpoint``; the loader must hand the file's own codes and scales to the BMM
schemes (no re-quantization): every absorbed weight dequantizes, in float64, to exactly codes x scale of
the file (decoded here with ml_dtypes and numpy, split per head by index arithmetic). Per-channel scales
are per output row of kv_b_proj: W_UV^T runs as fp8_per_channel, W_UK (whose rows are its reduction
axis) as fp8_per_block — and ``mlaq explain`` says exactly that, agreeing with the loaded model.
"""

from __future__ import annotations

import json
import logging

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.model import load_model
from mlaq.settings import Settings
from model_helpers import add_mtp_layer, decode_vs_prefill, edit_config, hf_checkpoint, read_tensors
from quant_helpers import quantize_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)
FP8 = Settings(fp8bmm=True, fp4bmm=False)  # must not touch a weight the checkpoint already quantized


def _file_kv_b(tensors: dict[str, torch.Tensor], layer: int, n: int, p: int, v: int):
    """(W_UK (N, P, L), W_UV^T (N, L, V)) of layer ``layer``, float64, from the file's codes and scale."""
    module = f"model.layers.{layer}.self_attn.kv_b_proj"
    codes = tensors[f"{module}.weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    scale = tensors[f"{module}.weight_scale"].float().numpy().astype(np.float64)
    full = codes.astype(np.float64) * scale.reshape(-1, 1)  # [N*(P+V), L]: one scale, or one per row
    per_head = full.reshape(n, p + v, -1)
    return per_head[:, :p], per_head[:, p:].transpose(0, 2, 1)


@pytest.mark.parametrize(
    ("model_type", "strategy", "scale_dtype"),
    [
        ("deepseek_v3", "tensor", torch.float32),
        ("deepseek_v3", "channel", torch.float32),
        ("glm4_moe_lite", "tensor", torch.float32),
        ("glm4_moe_lite", "channel", torch.bfloat16),  # llm-compressor stores a bf16 model's scales in bf16
    ],
)
def test_kv_b_proj_keeps_the_checkpoint_codes_and_scales(model_type, strategy, scale_dtype, tmp_path, caplog):
    hf, path = hf_checkpoint(model_type, tmp_path)
    add_mtp_layer(hf, path)  # the MTP layer's kv_b_proj is quantized too
    quantize_checkpoint(path, "compressed-tensors", strategy=strategy, scale_dtype=scale_dtype)
    with caplog.at_level(logging.INFO, logger="mlaq"):
        model = load_model(path, settings=FP8)
    scheme = f"fp8_per_{strategy}"
    scheme_uk = "fp8_per_block" if strategy == "channel" else scheme
    cfg = model.mla_config
    n, p, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    tensors = read_tensors(path)
    assert len(model.bmm_decisions) == hf.config.num_hidden_layers + 1
    for d in model.bmm_decisions:
        assert (d.source, d.scheme, d.rule.value, d.scheme_uk) == (scheme, scheme, "checkpoint", scheme_uk)
        absorbed = model.model.layers[d.layer].self_attn.absorbed
        assert (absorbed.scheme_uk.name, absorbed.scheme_uv.name) == (scheme_uk, scheme)
        uk, uv = _file_kv_b(tensors, d.layer, n, p, v)
        np.testing.assert_array_equal(absorbed.w_uk.dequantize(torch.float64).numpy(), uk)
        np.testing.assert_array_equal(absorbed.w_uv.dequantize(torch.float64).numpy(), uv)
    # nothing re-quantized, and nothing logged that claims it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or "re-derived" in r.getMessage()]
    assert any("re-quantized in none of" in r.getMessage() for r in caplog.records)
    # decode runs the FP8 BMMs: near the naive (checkpoint-precision) prefill, not equal to it
    rel = decode_vs_prefill(model)
    assert 0 < rel < 0.2, rel


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_explain_agrees_with_the_loaded_model(strategy, tmp_path, mlaq_cli):
    _, path = hf_checkpoint("glm4_moe_lite", tmp_path)
    quantize_checkpoint(path, "compressed-tensors", strategy=strategy)
    model = load_model(path, settings=OFF)
    explained = json.loads(
        mlaq_cli("explain", str(path), "--json", env={"MLAQ_FP8BMM": "0"}, check=True).stdout
    )
    assert explained.pop("weights_checked") is None  # explain read config files only
    assert explained == model.policy.to_json()
    reasons = {layer["reason"] for layer in explained["layers"]}
    assert len(reasons) == 1
    reason = reasons.pop()
    assert "stored codes and scales, not re-quantized" in reason
    if strategy == "channel":  # says what runs: W_UK as fp8_per_block, the V up-projection per channel
        assert "W_UK runs as fp8_per_block" in reason and "V up-projection runs as fp8_per_channel" in reason
    else:
        assert "fp8_per_block" not in reason and "W_UK" not in reason


def test_explicit_per_channel_target_keeps_the_stored_data(tmp_path):
    """targets naming the checkpoint's own scheme run the stored data too (the same split)."""
    _, path = hf_checkpoint("deepseek_v3", tmp_path)
    quantize_checkpoint(path, "compressed-tensors", strategy="channel")
    targets = '{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}'
    model = load_model(path, settings=OFF, quantization_config=targets)
    d = model.bmm_decisions[0]
    assert (d.rule.value, d.scheme, d.scheme_uk) == ("targets", "fp8_per_channel", "fp8_per_block")
    assert "W_UK runs as fp8_per_block" in d.reason
    cfg = model.mla_config
    uk, _ = _file_kv_b(read_tensors(path), 0, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
    absorbed = model.model.layers[0].self_attn.absorbed
    np.testing.assert_array_equal(absorbed.w_uk.dequantize(torch.float64).numpy(), uk)


def test_config_granularity_disagrees_with_the_file(tmp_path):
    _, path = hf_checkpoint("deepseek_v3", tmp_path)
    quantize_checkpoint(path, "compressed-tensors", strategy="channel")
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    edit_config(path, quantization_config=qc)
    with pytest.raises(
        ValueError, match=r"stored as fp8_per_tensor, but the safetensors file holds fp8_per_channel"
    ):
        load_model(path, settings=OFF)


def test_config_claims_a_format_the_file_does_not_hold(tmp_path):
    """Quark config: MXFP8 weights; the file holds kv_b_proj dense. Rule checkpoint would promise the
    stored MXFP8 data unchanged: refuse, rather than quantize the dense weight and call it the checkpoint's."""
    _, path = hf_checkpoint("deepseek_v3", tmp_path)
    mx = {"dtype": "fp8_e4m3", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
    qc = {
        "quant_method": "quark",
        "global_quant_config": {"weight": mx},
        "exclude": [],
        "layer_quant_config": {},
    }
    edit_config(path, quantization_config=qc)
    with pytest.raises(ValueError, match=r"stored as mxfp8, but the safetensors file holds dense"):
        load_model(path, settings=OFF)


def test_per_channel_checkpoint_as_fnuz_target_is_converted_exactly(tmp_path):
    """_fnuz target on a per-channel e4m3fn checkpoint: W_UK as fp8_per_block_fnuz, both exact."""
    _, path = hf_checkpoint("deepseek_v3", tmp_path)
    quantize_checkpoint(path, "compressed-tensors", strategy="channel")
    targets = '{"targets": {"re:.*kv_b_proj": "fp8_per_channel_fnuz"}}'
    model = load_model(path, settings=OFF, quantization_config=targets)
    d = model.bmm_decisions[0]
    assert (d.scheme, d.scheme_uk, d.requantized) == ("fp8_per_channel_fnuz", "fp8_per_block_fnuz", False)
    assert "converted exactly to e4m3fnuz" in d.reason and "W_UK runs as fp8_per_block_fnuz" in d.reason
    cfg = model.mla_config
    uk, uv = _file_kv_b(read_tensors(path), 0, cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
    absorbed = model.model.layers[0].self_attn.absorbed
    np.testing.assert_array_equal(absorbed.w_uk.dequantize(torch.float64).numpy(), uk)
    np.testing.assert_array_equal(absorbed.w_uv.dequantize(torch.float64).numpy(), uv)
