"""``--quantization online`` on every front door that takes ``--quantization-config`` (explain, validate,
generate, serve, audit): the same JSON means vLLM's (the kv_b_proj linear) everywhere, explain says what
vLLM computes for each format, and a bad combination is one line, exit != 0, no traceback."""

from __future__ import annotations

import json

import pytest

from mlaq.engine.llm import LLM
from mlaq.engine.sampling_params import SamplingParams


def _cfg(scheme: str) -> str:
    return json.dumps({"targets": {"re:.*kv_b_proj": scheme}})


def _one_line_error(res, text: str) -> None:
    assert res.returncode != 0, res.stdout[-500:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert text in lines[0], lines[0]


@pytest.mark.parametrize(
    ("scheme", "prefill"),
    [
        ("fp8_per_tensor", "prefill: c_kv quantized fp8 per token (dynamic) on sm90"),
        ("mxfp4", "E2M1 weight, E8M0 scales per 32 along the latent (EVEN rule); prefill: bf16 activations"),
        ("mxfp8", "E4M3 weight, E8M0 scales per 32 along the latent (ceil rule); prefill: bf16 activations"),
    ],
)
def test_explain_prints_each_formats_meaning(mlaq_cli, scheme, prefill):
    res = mlaq_cli("explain", "--quantization", "online", "--quantization-config", _cfg(scheme))
    assert res.returncode == 0, res.stderr
    assert f"  targets 're:.*kv_b_proj' = \"{scheme}\": kv_b_proj linear (vLLM's meaning" in res.stdout
    assert f"    {scheme}: " in res.stdout and prefill in res.stdout
    mlaq = mlaq_cli("explain", "--quantization-config", _cfg(scheme))
    assert "absorbed BMMs W_UK / W_UV (mlaq's meaning" in mlaq.stdout and f"    {scheme}: " in mlaq.stdout


def test_generate_runs_vllms_meaning(mlaq_cli):
    res = mlaq_cli(
        "generate", "--quantization", "online", "--quantization-config", _cfg("mxfp4"),
        "--prompt", "The cat", "--max-tokens", "3",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "-> 3 tokens" in res.stdout
    assert "as an online mxfp4 linear" in res.stderr


def test_llm_takes_vllms_quantization_argument():
    """``LLM(quantization="online", quantization_config=...)`` as vLLM's: prefill runs the online linear."""
    llm = LLM(_bundled(), quantization="online", quantization_config=_cfg("fp8_per_tensor"))
    attn = llm.engine.model.model.model.layers[0].self_attn
    assert attn.kv_b_online is not None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="--quantization online applies a --quantization-config"):
        LLM(_bundled(), quantization="online")


def _bundled():
    from mlaq.bundled import bundled_model_dir

    return bundled_model_dir()


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (("generate", "--quantization", "online", "--prompt", "x"), "--quantization online applies a"),
        (
            ("generate", "--quantization", "online", "--quantization-config", _cfg("mxfp4_w4a16"), "--prompt", "x"),
            "is not a vLLM online shorthand",
        ),
        (("serve", "--port", "0", "--quantization", "online", "--quantization-config", _cfg("fp8_per_block")),
         "--quantization online fp8_per_block: vLLM 0.32 splits W_UK / W_UV"),
        (("serve", "--port", "0", "--quantization", "online"), "--quantization online applies a"),
        (
            ("audit", "--quantization", "online", "--quantization-config", _cfg("mxfp4"), "--suggest-config",
             "--max-error", "0.1"),
            "--suggest-config writes targets that choose the absorbed BMMs",
        ),
        (
            ("explain", "--quantization", "online", "--platform", "rocm-gfx942", "--quantization-config", _cfg("mxfp4")),
            "--platform rocm-gfx942: ROCm gfx942 quantizes to e4m3fnuz",
        ),
        (
            ("validate", "--quantization", "online", "--quantization-config", _cfg("fp8_per_block"), "--as-configured"),
            "--quantization online fp8_per_block: vLLM 0.32 splits W_UK / W_UV",
        ),
        (
            ("validate", "--quantization", "online", "--quantization-config", _cfg("mxfp4"), "--as-configured",
             "--stream"),
            "--stream: vLLM's meaning of targets (--quantization online",
        ),
        (
            ("validate", "--quantization", "online", "--quantization-config", _cfg("mxfp4"), "--as-configured",
             "--precision", "absorbed"),
            "--precision absorbed: under --quantization online prefill runs vLLM's online kv_b_proj linear",
        ),
    ],
)  # fmt: skip
def test_bad_combinations_are_one_line(mlaq_cli, args, text):
    _one_line_error(mlaq_cli(*args), text)


def test_audit_reports_vllms_meaning(mlaq_cli):
    res = mlaq_cli(
        "audit", "--quantization", "online", "--quantization-config", _cfg("fp8_per_tensor"),
        "--schemes", "mxfp4", "--json", "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    record = json.loads(res.stdout)
    assert record["layers"][0]["policy"]["rule"] == "targets"
    assert "c_kv quantized fp8 per token" in record["layers"][0]["policy"]["reason"]
