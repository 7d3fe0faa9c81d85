"""The command line never dumps a traceback on a closed pipe, never takes a JSON flag with a key written
twice, never silently caps generate's --max-tokens at the context, and only advises a context the model
has."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import SRC, run_mlaq


def _closed_pipe_run(*args: str) -> subprocess.CompletedProcess:
    """``mlaq ARGS`` writing into a pipe whose reader has already gone (``mlaq explain | head -c 0``)."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    try:
        return subprocess.run(
            [sys.executable, "-m", "mlaq", *args], stdout=write, stderr=subprocess.PIPE, text=True, env=env
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "args", [("explain",), ("explain", "--json"), ("--help",), ("explain", "--help"), ("--version",)]
)
def test_a_closed_pipe_ends_quietly(args):
    r = _closed_pipe_run(*args)
    assert r.stderr == "", r.stderr
    assert r.returncode in (0, 141)  # 141: 128 + SIGPIPE, what a shell tool killed by the pipe reports


@pytest.mark.parametrize(
    ("flag", "value", "key"),
    [
        ("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, "num_speculative_tokens": 3}', "num_speculative_tokens"),
        ("--compilation-config", '{"inductor_compile_config": {"max_autotune": true, "max_autotune": false}}', "max_autotune"),
        ("--quantization-config", '{"targets": {"*": "mxfp4"}, "targets": {"*": "fp8_per_tensor"}}', "targets"),
    ],
)  # fmt: skip
def test_a_json_flag_with_a_key_written_twice_is_refused(flag, value, key):
    if flag == "--quantization-config":
        r = run_mlaq("explain", flag, value)
    else:
        r = run_mlaq("generate", "--prompt", "def", "--max-tokens", "1", "--compile", flag, value)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert f"duplicate key '{key}'" in lines[-1] and "Traceback" not in r.stderr, r.stderr


def test_generate_max_tokens_past_the_context_is_refused_not_capped():
    r = run_mlaq("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "5000", "--max-model-len", "64")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "3 tokens and --max-tokens 5000 asks for 5003, over the context of 64" in last, last
    assert "at most 61" in last and "raise --max-model-len (the model takes up to 4096)" in last
    assert r.stdout == ""  # nothing generated


def test_generate_at_the_models_full_context_does_not_advise_a_larger_one():
    r = run_mlaq("generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "5000")
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "over the context of 4096" in last and "--max-model-len" not in last, last


@pytest.mark.parametrize(("context", "advice"), [("4096", False), ("256", True)])
def test_validate_only_advises_a_context_the_model_has(context, advice):
    r = run_mlaq(
        "validate", "--context-len", context, "--prompt-len", "4000", "--max-tokens", "200", "--no-progress"
    )
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "do not fit the context" in last, last
    assert ("raise --context-len" in last) == advice, last  # never at the model's own maximum
    assert not advice or "(the model takes up to 4096)" in last
