"""What the vLLM plugin does to each MLA layer, from mlaq's decision (no vLLM needed: its facts are
arguments). The live check against vLLM's own MLAAttention is tests/test_vllm_plugin_live.py."""

from pathlib import Path

import pytest

from mlaq.integrations.vllm.compat import check_version
from mlaq.integrations.vllm.config import read_config
from mlaq.integrations.vllm.hooks import layer_index
from mlaq.integrations.vllm.plan import Kernels, checkpoint_files, make_plan
from mlaq.settings import Platform, VllmPluginEnv

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
POLICY = read_config({"mlaq": {"mode": "policy"}}, None)
GFX950 = Kernels(Platform.ROCM_GFX950, fp8bmm=True, fp4bmm=True)
GFX942 = Kernels(Platform.ROCM_GFX942, fp8bmm=True, fp4bmm=False)
FP4_SET, FP8_SET, UNSET = VllmPluginEnv(None, None, True), VllmPluginEnv(None, True, None), VllmPluginEnv()


def flags(
    name: str, env: VllmPluginEnv, kernels: Kernels, config=POLICY
) -> list[tuple[bool, bool, str | None]]:
    plan = make_plan(config, checkpoint_files(str(FIXTURES / name), {}), env, kernels)
    return [(a.fp8bmm, a.fp4bmm, a.emulate) for a in plan.actions]


def test_flags_unset_keep_bf16_where_vllm_would_requantize():
    # released vLLM 0.32 with AITER on runs mxfp4 here; mlaq honours the flags only when set
    assert set(flags("constructed--DeepSeek-V3-bf16", UNSET, GFX950)) == {(False, False, None)}


def test_fp4_set_on_gfx950_every_layer_mtp_included():
    got = flags("constructed--DeepSeek-V3-bf16", FP4_SET, GFX950)
    assert len(got) == 62 and set(got) == {(False, True, None)}


def test_fp4_set_on_gfx942_has_no_kernel():
    assert set(flags("constructed--DeepSeek-V3-bf16", FP4_SET, GFX942)) == {(False, False, None)}


def test_fp8_set_but_aiter_off_is_said_and_keeps_bf16():
    off = Kernels(Platform.ROCM_GFX942, fp8bmm=False, fp4bmm=False)
    plan = make_plan(
        POLICY, checkpoint_files(str(FIXTURES / "constructed--DeepSeek-V3-bf16"), {}), FP8_SET, off
    )
    assert {(a.fp8bmm, a.fp4bmm) for a in plan.actions} == {(False, False)}
    assert any("VLLM_ROCM_USE_AITER=1" in line for line in plan.lines())


def test_guarded_checkpoint_keeps_bf16_and_quark_family_opts_in():
    assert set(flags("constructed--GLM-5.2-MXFP4", FP4_SET, GFX950)) == {(False, False, None)}
    got = flags("quark-mxfp4--DeepSeek-V3.2", FP4_SET, GFX950)
    assert (False, True, None) in got


def test_stored_fp8_block_runs_dequantized_in_vllm_and_says_so():
    plan = make_plan(
        POLICY, checkpoint_files(str(FIXTURES / "deepseek-ai--DeepSeek-V3"), {}), FP8_SET, GFX950
    )
    assert {(a.fp8bmm, a.fp4bmm) for a in plan.actions} == {(False, False)}
    assert any("no BMM kernel for the stored fp8_per_block" in line for line in plan.lines())


def test_emulate_targets_only_the_matched_layers():
    cfg = read_config(
        {"mlaq": {"mode": "emulate", "targets": {"model.layers.1.self_attn.kv_b_proj": "mxfp4"}}}, None
    )
    got = flags("constructed--DeepSeek-V3-bf16", UNSET, GFX950, cfg)
    assert [i for i, (_, _, e) in enumerate(got) if e] == [1] and got[1][2] == "mxfp4"


def test_log_lines_one_per_group():
    plan = make_plan(
        POLICY, checkpoint_files(str(FIXTURES / "constructed--DeepSeek-V3-bf16"), {}), FP4_SET, GFX950
    )
    lines = plan.lines()
    assert lines[1].startswith("mlaq plugin: layers 0-60: mxfp4 (rule flag)")
    assert lines[2].startswith("mlaq plugin: layers 61 (MTP): mxfp4 (rule flag)")


def test_layer_index_from_vllm_prefixes():
    assert layer_index("model.layers.3.self_attn.attn") == 3
    assert layer_index("model.layers.61.mtp_block.self_attn.attn") == 61
    with pytest.raises(ValueError, match="cannot read the layer index"):
        layer_index("lm_head")


def test_other_vllm_versions_are_refused_with_the_versions_named():
    check_version("0.32.0")
    check_version("0.32.0+cpu")
    with pytest.raises(RuntimeError, match=r"tested against vLLM 0\.32\.0; this is vLLM 0\.33\.1"):
        check_version("0.33.1")
