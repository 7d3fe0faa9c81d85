"""--platform / --engine-defaults reach validate --as-configured and the loader."""

from __future__ import annotations

import pytest
import torch

from mlaq.cli import build_parser
from mlaq.cli.validate import config_from_args
from mlaq.model.loading.loader import load_model
from mlaq.settings import Engine, Platform, Settings, VllmRocmEnv
from model_helpers import hf_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    _, path = hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("plat"), torch_dtype="bfloat16")
    (path / "heldout.txt").write_text("held-out text\n")
    return path


def _args(*argv: str):
    return build_parser().parse_args(["validate", *argv])


def test_validate_settings_carry_platform_and_engine(ckpt, monkeypatch):
    monkeypatch.setenv("MLAQ_FP8BMM", "1")
    monkeypatch.setenv("VLLM_ROCM_USE_AITER", "1")
    cfg = config_from_args(_args(str(ckpt), "--as-configured", "--platform", "rocm-gfx942"))
    assert cfg.settings == Settings(fp8bmm=True, platform=Platform.ROCM_GFX942)
    cfg = config_from_args(
        _args(str(ckpt), "--as-configured", "--platform", "rocm-gfx950", "--engine-defaults", "vllm-0.32")
    )
    assert cfg.settings.engine is Engine.VLLM_032 and cfg.settings.vllm == VllmRocmEnv(True, True, True)
    with pytest.raises(ValueError, match="add --as-configured"):
        config_from_args(_args(str(ckpt), "--platform", "cuda"))


def test_loader_runs_the_platform_decision(ckpt):
    s = Settings(fp8bmm=True, platform=Platform.ROCM_GFX942)
    model = load_model(ckpt, dtype=torch.float32, settings=s)
    assert {d.scheme for d in model.bmm_decisions} == {"fp8_per_tensor_fnuz"}
    s = Settings(platform=Platform.ROCM_GFX950, engine=Engine.VLLM_032, vllm=VllmRocmEnv(aiter=True))
    model = load_model(ckpt, dtype=torch.float32, settings=s)
    assert {d.scheme for d in model.bmm_decisions} == {"mxfp4"}  # vLLM 0.32's silent FP4 BMM


def test_loader_refuses_vllm_online_targets_it_cannot_emulate(ckpt):
    s = Settings(platform=Platform.CUDA, engine=Engine.VLLM_032, vllm=VllmRocmEnv())
    with pytest.raises(
        ValueError, match=r"--quantization online fp8_per_block: vLLM 0.32 splits W_UK / W_UV"
    ):
        load_model(ckpt, settings=s, quantization_config='{"targets": {"re:.*kv_b_proj": "fp8_per_block"}}')


def test_validate_reads_quantization_online(ckpt):
    """``--quantization online`` reaches validate's as-configured model: targets mean the kv_b_proj linear."""
    fp8 = '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'
    cfg = config_from_args(_args(str(ckpt), "--quantization", "online", "--quantization-config", fp8))
    assert cfg.as_configured and cfg.quantization == "online" and cfg.policy_config().online
    assert config_from_args(_args(str(ckpt), "--quantization-config", fp8)).policy_config() == fp8
    with pytest.raises(ValueError, match="--quantization online applies a --quantization-config"):
        config_from_args(_args(str(ckpt), "--as-configured", "--quantization", "online"))
