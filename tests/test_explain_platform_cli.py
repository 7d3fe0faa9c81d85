"""``mlaq explain`` front door for --platform / --engine-defaults / --check-weights / the vLLM log line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlaq.cli import main
from model_helpers import hf_checkpoint, read_tensors, write_tensors

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
GLM52 = str(FIXTURES / "constructed--GLM-5.2-MXFP4")


@pytest.fixture
def env(monkeypatch):
    for var in (
        "MLAQ_FP8BMM",
        "MLAQ_FP4BMM",
        "VLLM_ROCM_USE_AITER",
        "VLLM_ROCM_USE_AITER_FP8BMM",
        "VLLM_ROCM_USE_AITER_FP4BMM",
    ):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def explain(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["explain", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_engine_defaults_on_gfx950_with_aiter(env, capsys):
    env.setenv("VLLM_ROCM_USE_AITER", "1")
    rc, out, err = explain(capsys, GLM52, "--platform", "rocm-gfx950", "--engine-defaults", "vllm-0.32")
    assert rc == 0 and err == ""
    assert "Re-quantizing kv_b_proj in 79 of 79 MLA layers to mxfp4 (VLLM_ROCM_USE_AITER=1" in out
    assert "mlaq's own decision on rocm-gfx950" in out
    assert "kv_b_proj re-quantized in none of 79 MLA layers: 79 bf16 (rule default)." in out


def test_platform_line_and_flag_on_cuda(env, capsys):
    env.setenv("MLAQ_FP8BMM", "1")
    rc, out, _ = explain(capsys, str(FIXTURES / "constructed--DeepSeek-V3-bf16"), "--platform", "cuda")
    assert rc == 0
    assert "platform:    cuda (no AITER" in out
    assert "MLAQ_FP8BMM=1 names an AITER BMM that vLLM 0.32 does not run on cuda" in out


def test_engine_defaults_need_platform_and_bad_vllm_spelling(env, capsys):
    rc, _, err = explain(capsys, GLM52, "--engine-defaults", "vllm-0.32")
    assert rc == 2 and "needs --platform" in err and err.count("\n") == 1
    env.setenv("VLLM_ROCM_USE_AITER", "yes")
    rc, _, err = explain(capsys, GLM52, "--platform", "rocm-gfx942", "--engine-defaults", "vllm-0.32")
    assert rc == 2 and "VLLM_ROCM_USE_AITER='yes': vLLM 0.32 reads anything but true/1 as False" in err


def test_quantizing_line_as_vllm_logs_it(env, capsys, tmp_path):
    f = tmp_path / "q.json"
    f.write_text('{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}')
    rc, out, _ = explain(capsys, GLM52, "--quantization-config", str(f))
    assert rc == 0
    want = "Quantizing 79 layers of types: self_attn.kv_b_proj: 79 (from targets: re:.*kv_b_proj, fp8_per_channel)"
    assert want in out.splitlines()


@pytest.fixture(scope="module")
def nan_ckpt(tmp_path_factory):
    _, path = hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("nan"))
    tensors = read_tensors(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    w = tensors["model.layers.1.self_attn.kv_b_proj.weight"].clone()
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), float("inf"), float("-inf")
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = w
    write_tensors(path, tensors)
    return path


def test_check_weights_reports_nan_and_inf(env, capsys, nan_ckpt):
    rc, out, _ = explain(capsys, str(nan_ckpt))
    assert rc == 0 and "weights:     not read (explain reads config files only)" in out
    rc, out, _ = explain(capsys, str(nan_ckpt), "--check-weights")
    assert rc == 1
    assert "1 of 3 kv_b_proj weights hold NaN/inf" in out
    assert "model.layers.1.self_attn.kv_b_proj: 1 NaN, 2 inf" in out
    rc, out, _ = explain(capsys, str(nan_ckpt), "--check-weights", "--json")
    obj = json.loads(out)
    assert obj["weights_checked"] == {
        "layers_read": 3,
        "non_finite": [{"module": "model.layers.1.self_attn.kv_b_proj", "nan": 1, "inf": 2}],
    }


def test_check_weights_clean(env, capsys, tmp_path):
    _, path = hf_checkpoint("deepseek_v3", tmp_path / "ok")
    rc, out, _ = explain(capsys, str(path), "--check-weights")
    assert rc == 0 and "kv_b_proj of all 3 MLA layers read: every value finite" in out
    assert torch.isfinite(read_tensors(path)["model.layers.0.self_attn.kv_b_proj.weight"]).all()
