"""--engine-defaults sglang-0.5.23: each rule as read from SGLang 0.5.23's source (deepseek_weight_loader.py
post_load_weights, forward_mla_rocm.py, forward_mla.py, configs/model_config.py), per platform x checkpoint
kind x SGLANG_USE_AITER / SGLANG_USE_DEEPGEMM_BMM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaq.cli import main
from mlaq.policy import decide_from_dir
from mlaq.policy.explain import explain
from mlaq.policy.sglang0523 import SglangCrash
from mlaq.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
GLM52 = FIXTURES / "constructed--GLM-5.2-MXFP4"  # GlmMoeDsaForCausalLM, Quark, kv_b_proj bf16
GLM51 = FIXTURES / "zai-org--GLM-5.1-FP8"  # GlmMoeDsaForCausalLM, block FP8
DSV3 = FIXTURES / "deepseek-ai--DeepSeek-V3"  # block FP8 kv_b_proj
DSV32Q = FIXTURES / "quark-mxfp4--DeepSeek-V3.2"  # Quark, DeepseekV32ForCausalLM, kv_b_proj bf16
CT = FIXTURES / "constructed--DeepSeek-V3-FP8-dynamic-ct"  # compressed-tensors per-channel FP8
BF16 = FIXTURES / "constructed--DeepSeek-V3-bf16"  # no quantization config
VARS = ("SGLANG_USE_AITER", "SGLANG_USE_DEEPGEMM_BMM", "VLLM_ROCM_USE_AITER", "MLAQ_FP8BMM", "MLAQ_FP4BMM")


def sglang(path: Path, platform: str, **env: str):
    s = Settings.from_env(env, platform=platform, engine="sglang-0.5.23")
    return decide_from_dir(path, s, log=False)


def rows(result) -> set[tuple[bool, str, str | None, str]]:
    """{(mtp, W_UV scheme, W_UK scheme if different, rule)}."""
    return {
        (d.mtp, d.scheme, d.scheme_uk if d.scheme_uk != d.scheme else None, d.rule.value)
        for d in result.layers
    }


AITER = {"SGLANG_USE_AITER": "1"}
W8 = "fp8_per_tensor_w8a16_sglang"
AITER_FP8 = "fp8_per_tensor_sglang"
TABLE = [
    # GLM-5 bf16 kv_b_proj: e4m3fn one scale on gfx950 with AITER only; the MTP draft untouched
    (
        GLM52,
        "rocm-gfx950",
        AITER,
        {(False, "fp8_per_tensor_sglang", None, "flag"), (True, "bf16", None, "default")},
    ),
    (GLM52, "rocm-gfx950", {}, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    (GLM52, "rocm-gfx942", AITER, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    (GLM52, "cuda", AITER, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    # Quark, but DeepseekV32ForCausalLM: the forced MXFP4 tests architectures[0] == DeepseekV3ForCausalLM
    (DSV32Q, "rocm-gfx950", AITER, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    # block FP8 on CUDA: dequantized to bf16, or DeepGEMM's blocks with SGLANG_USE_DEEPGEMM_BMM=1
    (DSV3, "cuda", {}, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    (
        DSV3,
        "cuda",
        {"SGLANG_USE_DEEPGEMM_BMM": "1"},
        {(m, "fp8_per_block", None, "flag") for m in (False, True)},
    ),
    # block FP8 off CUDA: re-quantized to one scale
    (DSV3, "rocm-gfx950", {}, {(m, W8, None, "default") for m in (False, True)}),
    (DSV3, "rocm-gfx950", AITER, {(m, "fp8_per_tensor_sglang", None, "flag") for m in (False, True)}),
    (
        DSV3,
        "rocm-gfx942",
        AITER,
        {(m, f"{W8}_fnuz", "fp8_per_tensor_sglang_fnuz", "flag") for m in (False, True)},
    ),
    (DSV3, "cpu", {}, {(m, W8, None, "default") for m in (False, True)}),
    (GLM51, "rocm-gfx950", AITER, {(m, "fp8_per_tensor_sglang", None, "flag") for m in (False, True)}),
    # compressed-tensors ignores self_attn: bf16 everywhere
    (CT, "cuda", {}, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
    (BF16, "rocm-gfx950", AITER, {(False, "bf16", None, "default"), (True, "bf16", None, "default")}),
]


@pytest.mark.parametrize("path, platform, env, want", TABLE)
def test_sglang_rules(path, platform, env, want):
    assert rows(sglang(path, platform, **env)) == want


def test_quark_deepseek_v3_forced_mxfp4_on_gfx950(tmp_path):
    """A Quark DeepseekV3ForCausalLM checkpoint with kv_b_proj excluded (bf16): MXFP4 with AITER on gfx950."""
    config = json.loads((DSV32Q / "config.json").read_text())
    config["architectures"] = ["DeepseekV3ForCausalLM"]
    config["model_type"] = "deepseek_v3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = sglang(tmp_path, "rocm-gfx950", **AITER)
    assert rows(r) == {(False, "mxfp4", None, "family-opt-in"), (True, "bf16", None, "default")}
    assert "no setting turns this off" in r.layers[0].reason
    assert rows(sglang(tmp_path, "rocm-gfx950")) == {
        (False, "bf16", None, "default"),
        (True, "bf16", None, "default"),
    }


def test_per_channel_fp8_on_cuda_runs_bmm_fp8_with_a_batch_scale(tmp_path):
    config = json.loads((CT / "config.json").read_text())
    config["quantization_config"]["ignore"] = ["lm_head"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert rows(sglang(tmp_path, "cuda")) == {
        (m, "fp8_per_tensor_batch_sglang", None, "default") for m in (False, True)
    }
    assert rows(sglang(tmp_path, "rocm-gfx950")) == {(m, W8, None, "default") for m in (False, True)}


def test_crashing_configurations_are_reported():
    with pytest.raises(SglangCrash, match="gfx942 with an FP8 kv_b_proj and SGLANG_USE_AITER unset crashes"):
        sglang(DSV3, "rocm-gfx942")
    with pytest.raises(SglangCrash, match="no absorbed-BMM path for a kv_b_proj stored as mxfp4"):
        sglang(FIXTURES / "constructed--DeepSeek-R1-0528-MXFP4", "cuda")


def test_settings_and_errors():
    with pytest.raises(
        ValueError, match=r"SGLANG_USE_AITER='yes'.*get_bool_env_var treats anything else as False"
    ):
        Settings.from_env({"SGLANG_USE_AITER": "yes"}, engine="sglang-0.5.23")
    with pytest.raises(ValueError, match="needs --platform"):
        sglang(DSV3, None)  # type: ignore[arg-type]
    s = Settings.from_env({}, platform="cuda", engine="sglang-0.5.23")
    with pytest.raises(ValueError, match="takes no --quantization-config"):
        decide_from_dir(DSV3, s, '{"targets": {"re:.*kv_b_proj": "bf16"}}', log=False)
    with pytest.raises(ValueError, match="architecture 'Glm4MoeForCausalLM' is not one"):
        config = {"architectures": ["Glm4MoeForCausalLM"], "kv_lora_rank": 512, "num_hidden_layers": 1}
        from mlaq.policy import decide, mla_model
        from mlaq.policy.checkpoint import NoQuant

        decide(mla_model(config), NoQuant(), s)


def test_explain_shows_sglang_beside_vllm_and_mlaq(capsys, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    found = explain(GLM52, Settings.from_env({}, platform="rocm-gfx950", engine="sglang-0.5.23"))
    assert found.vllm is not None and found.mlaq is not None and found.aiter_on is not None
    text = found.text(str(GLM52))
    assert "engine:      released SGLang 0.5.23" in text
    assert "With SGLANG_USE_AITER=1 (AMD's ROCm recipes set it), SGLang 0.5.23:" in text
    assert "vLLM 0.32 on rocm-gfx950 with its defaults (VLLM_ROCM_USE_AITER=0" in text
    assert "mlaq's own decision on rocm-gfx950" in text
    out = found.to_json()
    assert {"mlaq", "vllm-0.32", "with_SGLANG_USE_AITER=1"} <= set(out)
    assert out["settings"]["engine"] == "sglang-0.5.23" and out["settings"]["SGLANG_USE_AITER"] is False
    assert {d["scheme"] for d in out["with_SGLANG_USE_AITER=1"]["layers"]} == {
        "fp8_per_tensor_sglang",
        "bf16",
    }
    # gfx942 block FP8: SGLang crashes unless SGLANG_USE_AITER=1; the CLI says so in one line
    rc = main(["explain", str(DSV3), "--platform", "rocm-gfx942", "--engine-defaults", "sglang-0.5.23"])
    err = capsys.readouterr().err
    assert rc == 2 and "crashes in its first CUDA-graph capture" in err and err.count("\n") == 1


def test_loaded_model_runs_sglang_gfx942_bmms_with_one_shared_scale(tmp_path):
    """A block-FP8 checkpoint as SGLang 0.5.23 runs it on gfx942 with AITER: the whole kv_b_proj
    re-quantized to one e4m3fnuz scale (max 224), W_UK through AITER's a8w8 BMM, W_UV weight-only."""
    import torch

    from mlaq.bmm.sglang_fp8 import sglang_input_to_float8
    from mlaq.formats import Fp8Dtype
    from mlaq.model import load_model
    from model_helpers import decode_vs_prefill, hf_checkpoint
    from quant_helpers import quantize_checkpoint

    _, path = hf_checkpoint("deepseek_v3", tmp_path)
    exact = quantize_checkpoint(path, "fp8")
    s = Settings.from_env(AITER, platform="rocm-gfx942", engine="sglang-0.5.23")
    model = load_model(path, settings=s)
    cfg = model.mla_config
    n, p, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    for d in (d for d in model.bmm_decisions if not d.mtp):  # transformers saved no MTP layer
        absorbed = model.model.layers[d.layer].self_attn.absorbed
        assert (absorbed.scheme_uk.name, absorbed.scheme_uv.name) == (f"{AITER_FP8}_fnuz", f"{W8}_fnuz")
        whole = exact[f"model.layers.{d.layer}.self_attn.kv_b_proj.weight"]
        codes, scale = sglang_input_to_float8(whole, Fp8Dtype.E4M3FNUZ)
        assert float(absorbed.w_uk.scale) == float(absorbed.w_uv.scale) == float(scale)
        per_head = codes.view(n, p + v, -1).view(torch.uint8)
        assert torch.equal(absorbed.w_uk.codes.view(torch.uint8), per_head[:, :p])
    assert 0 < decode_vs_prefill(model) < 0.2
