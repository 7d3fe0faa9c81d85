"""--platform x flag, and --engine-defaults vllm-0.32, each rule as read from vLLM 0.32's source
(vllm/_aiter_ops.py, vllm/envs.py, vllm/platforms/rocm.py, model_executor/layers/attention/mla_attention.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mlaq.policy import decide, decide_from_dir, mla_model
from mlaq.policy.checkpoint import NoQuant
from mlaq.policy.explain import explain
from mlaq.settings import Engine, Platform, Settings, VllmRocmEnv

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
GLM52 = FIXTURES / "constructed--GLM-5.2-MXFP4"  # Quark MXFP4, kv_b_proj excluded (bf16)
DSV3 = FIXTURES / "deepseek-ai--DeepSeek-V3"  # block FP8 kv_b_proj
BF16 = FIXTURES / "constructed--DeepSeek-V3-bf16"  # no quantization config
ARCH = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "kv_lora_rank": 512, "torch_dtype": "bfloat16"}
G942, G950, CUDA, CPU = Platform.ROCM_GFX942, Platform.ROCM_GFX950, Platform.CUDA, Platform.CPU
FLAGS = {"off": (False, False), "fp8": (True, False), "fp4": (False, True), "both": (True, True)}


def one(result) -> tuple[str, str]:
    got = {(d.scheme, d.rule.value) for d in result.layers}
    assert len(got) == 1, got
    return got.pop()


# mlaq's policy on each platform, bf16 source, no quantization config
MLAQ_TABLE = {
    (None, "off"): ("bf16", "default"),
    (None, "fp8"): ("fp8_per_tensor", "flag"),
    (None, "fp4"): ("mxfp4", "flag"),
    (None, "both"): ("mxfp4", "flag"),
    (G950, "off"): ("bf16", "default"),
    (G950, "fp8"): ("fp8_per_tensor", "flag"),  # e4m3fn on gfx950
    (G950, "fp4"): ("mxfp4", "flag"),
    (G950, "both"): ("mxfp4", "flag"),
    (G942, "off"): ("bf16", "default"),
    (G942, "fp8"): ("fp8_per_tensor_fnuz", "flag"),  # e4m3fnuz on gfx942
    (G942, "fp4"): ("bf16", "platform"),  # no FP4 BMM below CDNA 4
    (G942, "both"): ("fp8_per_tensor_fnuz", "flag"),  # FP4 missing -> the FP8 branch, as vLLM's elif
    (CUDA, "off"): ("bf16", "default"),
    (CUDA, "fp8"): ("bf16", "platform"),
    (CUDA, "fp4"): ("bf16", "platform"),
    (CUDA, "both"): ("bf16", "platform"),
    (CPU, "off"): ("bf16", "default"),
    (CPU, "fp8"): ("bf16", "platform"),
    (CPU, "fp4"): ("bf16", "platform"),
    (CPU, "both"): ("bf16", "platform"),
}


@pytest.mark.parametrize("plat, flags", list(MLAQ_TABLE))
def test_mlaq_policy_platform_by_flag(plat, flags):
    fp8, fp4 = FLAGS[flags]
    r = decide(mla_model(ARCH), NoQuant(), Settings(fp8, fp4, platform=plat))
    assert one(r) == MLAQ_TABLE[(plat, flags)]
    if MLAQ_TABLE[(plat, flags)][1] == "platform":
        assert f"does not run on {plat}" in r.layers[0].reason


def test_gfx942_converts_stored_e4m3fn_exactly_and_refuses_mx_targets():
    r = decide_from_dir(DSV3, Settings(platform=G942), log=False)
    assert {(d.scheme, d.rule.value) for d in r.layers} == {("fp8_per_block_fnuz", "checkpoint")}
    assert all(d.converts_to_fnuz for d in r.layers)
    assert "normalize_e4m3fn_to_e4m3fnuz" in r.layers[0].reason
    qc = '{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}'
    r = decide_from_dir(BF16, Settings(platform=G942), qc, log=False)
    assert one(r) == ("fp8_per_channel_fnuz", "targets")
    with pytest.raises(ValueError, match="needs MX hardware, which rocm-gfx942 lacks"):
        decide_from_dir(BF16, Settings(platform=G942), '{"targets": {"re:.*kv_b_proj": "mxfp4"}}', log=False)
    with pytest.raises(ValueError, match="only rocm-gfx942 uses"):
        decide_from_dir(
            BF16, Settings(platform=G950), '{"targets": {"re:.*kv_b_proj": "fp8_per_block_fnuz"}}'
        )


def test_sm90_targets_run_on_cuda_only():
    qc = '{"targets": {"re:.*kv_b_proj": "fp8_per_block_sm90"}}'
    assert one(decide_from_dir(BF16, Settings(platform=CUDA), qc, log=False)) == (
        "fp8_per_block_sm90",
        "targets",
    )
    assert one(decide_from_dir(BF16, Settings(), qc, log=False)) == ("fp8_per_block_sm90", "targets")
    for plat in (G942, G950, CPU):
        with pytest.raises(ValueError, match=f"Hopper .* which {plat} does not run; use fp8_per_block$"):
            decide_from_dir(BF16, Settings(platform=plat), qc, log=False)


def vllm(plat: Platform, aiter: bool = True, fp8: bool = True, fp4: bool = True) -> Settings:
    return Settings(platform=plat, engine=Engine.VLLM_032, vllm=VllmRocmEnv(aiter, fp8, fp4))


# vLLM 0.32 per platform on three sources: bf16 excluded by a Quark config (GLM-5.2), bf16 without config,
# block FP8 (DeepSeek-V3); VLLM_ROCM_USE_AITER=1 and the BMM flags at their defaults
VLLM_TABLE = {
    G950: {GLM52: ("mxfp4", "flag"), BF16: ("mxfp4", "flag"), DSV3: ("fp8_per_tensor", "flag")},
    G942: {
        GLM52: ("fp8_per_tensor_fnuz", "flag"),
        BF16: ("fp8_per_tensor_fnuz", "flag"),
        DSV3: ("fp8_per_tensor_fnuz", "flag"),
    },
    CUDA: {GLM52: ("bf16", "default"), BF16: ("bf16", "default"), DSV3: ("bf16", "default")},
    CPU: {GLM52: ("bf16", "default"), BF16: ("bf16", "default"), DSV3: ("bf16", "default")},
}


@pytest.mark.parametrize("plat", list(VLLM_TABLE))
@pytest.mark.parametrize("ckpt", [GLM52, BF16, DSV3], ids=["glm52-mxfp4", "bf16", "dsv3-fp8"])
def test_vllm_032_defaults(plat, ckpt):
    r = decide_from_dir(ckpt, vllm(plat), log=False)
    assert one(r) == VLLM_TABLE[plat][ckpt]


def test_vllm_032_flags_and_master_switch():
    assert one(decide_from_dir(GLM52, vllm(G950, aiter=False), log=False)) == ("bf16", "default")
    assert one(decide_from_dir(GLM52, vllm(G950, fp4=False), log=False)) == ("fp8_per_tensor", "flag")
    assert one(decide_from_dir(GLM52, vllm(G950, fp4=False, fp8=False), log=False)) == ("bf16", "default")
    # an FP8 checkpoint on CUDA: vLLM dequantizes kv_b_proj to bf16 for the BMMs
    d = decide_from_dir(DSV3, vllm(CUDA), log=False).layers[0]
    assert (d.source, d.scheme, d.requantized) == ("fp8_per_block", "bf16", False)
    assert "dequantized to bf16" in d.reason


def test_vllm_032_targets_read_as_online_linear():
    qc = '{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}'
    r = decide_from_dir(BF16, vllm(CUDA), qc, log=False)
    assert one(r) == ("bf16", "targets") and all(
        d.online == "fp8_per_channel" and d.requantized for d in r.layers
    )
    r = decide_from_dir(BF16, vllm(G950), qc, log=False)  # the online weight is bf16 at init: FP4 BMM on top
    assert one(r) == ("mxfp4", "targets")
    with pytest.raises(ValueError, match=r"mlaq.s, not a vLLM 0\.32 online shorthand"):
        decide_from_dir(BF16, vllm(CUDA), '{"targets": {"re:.*kv_b_proj": "fp8_per_head"}}', log=False)
    with pytest.raises(ValueError, match="needs --platform"):
        decide_from_dir(BF16, Settings(engine=Engine.VLLM_032, vllm=VllmRocmEnv()), log=False)


def test_vllm_env_defaults_and_spellings():
    assert VllmRocmEnv.from_env({}) == VllmRocmEnv(aiter=False, fp8bmm=True, fp4bmm=True)  # vllm/envs.py
    assert VllmRocmEnv.from_env(
        {"VLLM_ROCM_USE_AITER": "TRUE", "VLLM_ROCM_USE_AITER_FP4BMM": "0"}
    ) == VllmRocmEnv(True, True, False)
    with pytest.raises(ValueError, match=r"vLLM 0\.32 reads anything but true/1 as False"):
        VllmRocmEnv.from_env({"VLLM_ROCM_USE_AITER": "on"})
    s = Settings.from_env({"VLLM_ROCM_USE_AITER": "on"})  # not read unless the engine is vllm-0.32
    assert s.vllm is None


def test_explain_shows_the_silent_mxfp4_next_to_mlaq():
    s = Settings.from_env({}, platform="rocm-gfx950", engine="vllm-0.32")
    found = explain(GLM52, s)
    assert one(found.result) == ("bf16", "default")  # VLLM_ROCM_USE_AITER unset: vLLM's default
    assert found.aiter_on is not None and one(found.aiter_on) == ("mxfp4", "flag")
    assert found.mlaq is not None and one(found.mlaq) == ("bf16", "default")
    text = found.text(str(GLM52))
    assert (
        "With VLLM_ROCM_USE_AITER=1" in text
        and "Re-quantizing kv_b_proj in 79 of 79 MLA layers to mxfp4" in text
    )
    assert "mlaq's own decision on rocm-gfx950" in text
    on = explain(GLM52, replace(s, vllm=VllmRocmEnv(aiter=True)))
    assert on.aiter_on is None and one(on.result) == ("mxfp4", "flag")
    assert set(on.to_json()) == {"model_type", "settings", "layers", "mlaq"}
    assert on.to_json()["settings"]["engine"] == "vllm-0.32"
