"""Bad input as a new user gives it (issue 13 §8): every error is one line naming what to fix, exit != 0,
no traceback, nothing changed; Ctrl-C during validate is one line and exit 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import SRC
from mlaq.cli import main
from mlaq.outputs import note_written

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from model_helpers import read_tensors, write_tensors
from validate_helpers import MAX_POSITIONS, tiny_checkpoint

HUB_ID = "deepseek-ai/DeepSeek-V3"
MTP2 = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("bad_input"))


def one_line_error(capsys, *argv: str) -> str:
    """Run ``mlaq ARGV`` in-process; assert it failed with one line on stderr and no traceback."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip() and "warning:" not in x]
    assert rc != 0, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- --out -----------------------------------------------------------------------------------------
def _no_measuring(monkeypatch) -> None:
    def measure(*_a, **_k):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr("mlaq.validate.sources.engine.EngineSource.measure", measure)


@pytest.mark.parametrize("where", ["file", "file/sub", "/proc/mlaq-x", "/sys/mlaq-x"])
def test_bad_out_is_refused_before_measuring(where, tmp_path, monkeypatch, capsys) -> None:
    if where.startswith("/") and not os.path.isdir(os.path.dirname(where)):
        pytest.skip(f"no {os.path.dirname(where)} here")
    f = tmp_path / "file"
    f.write_text("keep me")
    out = str(tmp_path / where) if not where.startswith("/") else where
    _no_measuring(monkeypatch)
    line = one_line_error(capsys, "validate", "--out", out, "--no-progress")
    assert f"--out {out}" in line
    assert f.read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
    assert not os.path.exists(out) or where == "file"


def test_results_are_printed_before_a_failing_write(tmp_path, monkeypatch, capsys) -> None:
    from test_validate_record import hand_record

    monkeypatch.setattr("mlaq.validate.sources.engine.EngineSource.measure", lambda *_a, **_k: hand_record())

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("mlaq.validate.report.write_report", disk_full)
    out = tmp_path / "out"
    rc = main(["validate", "--out", str(out), "--json", "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 1
    assert json.loads(cap.out)["schemes"]["mxfp4"]["kl"] == 1.0  # the results, complete
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err
    assert f"--out {out}: could not write the report (No space left on device)" in lines[0]


# -- Ctrl-C ------------------------------------------------------------------------------------------
def _default_sigint() -> None:  # the suite may run as a background job, where SIGINT is ignored
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_validate_is_one_line_and_keeps_the_report(ckpt, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "report.md").write_text("previous report")
    note_written(out, ["report.md"])  # mlaq's report of an earlier run
    # plain progress lines (no rich) tell when measuring has begun
    code = "import sys; sys.modules['rich'] = None; from mlaq.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "validate", str(ckpt), "--out", str(out), "--schemes", "mxfp4"]
    argv += [
        "--context-len",
        "64",
        "--windows",
        "30",
        "--prompts",
        "2",
        "--prompt-len",
        "16",
        "--max-tokens",
        "8",
    ]
    argv += ["--tasks", "none"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        argv, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=_default_sigint
    )
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        if line.startswith("validate [") or not line:
            break
    assert seen[-1].startswith("validate [") and proc.poll() is None, "".join(seen)  # measuring
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1] == (
        "mlaq validate: interrupted; nothing was written (a previous report stays as it was)"
    )
    assert (out / "report.md").read_text() == "previous report"
    assert sorted(p.name for p in out.iterdir()) == [".mlaq-outputs.json", "report.md"]


# -- speculative decoding ----------------------------------------------------------------------------
def test_k_beyond_max_tokens_drafts_what_the_request_can_use(ckpt, capsys) -> None:
    from mlaq.engine.llm import LLM
    from mlaq.engine.sampling_params import SamplingParams

    llm = LLM(
        str(ckpt), max_model_len=128, speculative_config='{"method": "mtp", "num_speculative_tokens": 100}'
    )
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=8))
    s = llm.spec_decoding_stats
    assert len(outs[0].outputs[0].token_ids) == 8
    # vLLM's scheduler: a step computes at most prompt + max_tokens - 1 tokens, so the first step after
    # the prefill (1 token out, 7 to go) drafts 6, and accepted drafts never exceed the tokens emitted
    assert s.num_drafts >= 1 and s.num_draft_tokens <= 6 * s.num_drafts
    assert s.num_accepted_tokens <= 8 - 1
    rc = main(["generate", str(ckpt), "--prompt-token-ids", "5,6", "--max-tokens", "2", "--speculative-config",
               '{"method": "mtp", "num_speculative_tokens": 4}'])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "warning: 4 speculative tokens per step exceed what --max-tokens 2 can use" in err


def test_speculative_config_without_method_is_refused_as_vllm_does(ckpt, capsys) -> None:
    line = one_line_error(capsys, "generate", str(ckpt), "--prompt-token-ids", "1", "--speculative-config",
                          '{"num_speculative_tokens": 2}')  # fmt: skip
    assert 'speculative_config needs "method" (vLLM requires it)' in line


def test_missing_k_message_has_a_whole_example(ckpt, capsys) -> None:
    line = one_line_error(
        capsys, "generate", str(ckpt), "--prompt-token-ids", "1", "--speculative-config", '{"method": "mtp"}'
    )
    assert line.endswith(
        'needs "num_speculative_tokens", e.g. {"method": "mtp", "num_speculative_tokens": 3}'
    )


# -- checkpoints ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv", [["explain"], ["generate", "--prompt", "hi"], ["validate", "--no-progress"]], ids=lambda a: a[0]
)
def test_a_hub_id_is_not_a_local_directory(argv, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, argv[0], HUB_ID, *argv[1:])
    assert line.endswith(
        f"{HUB_ID}: not a local directory; mlaq does not download (hf download {HUB_ID} --local-dir DIR "
        "first, then pass the directory)"
    ), line


def test_pytorch_bin_only_is_refused_first_and_never_unpickled(ckpt, tmp_path, monkeypatch, capsys) -> None:
    import pickle

    import torch

    d = tmp_path / "bin_only"
    d.mkdir()
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    (d / "pytorch_model.bin").write_bytes(pickle.dumps({"not": "read"}))

    def never(*_a, **_k):
        raise AssertionError("unpickled")

    for mod, name in ((pickle, "load"), (pickle, "loads"), (torch, "load")):
        monkeypatch.setattr(mod, name, never)
    # no heldout.txt and no tokenizer.json either: the checkpoint's problem is said first
    line = one_line_error(capsys, "validate", str(d), "--no-progress")
    assert "holds pytorch_model.bin but no model.safetensors" in line and "never unpickles" in line


def test_prompt_beyond_the_context_gets_advice_that_can_work(ckpt, capsys) -> None:
    n = MAX_POSITIONS + 10
    line = one_line_error(capsys, "generate", str(ckpt), "--prompt-token-ids", ",".join(["3"] * n))
    assert (
        f"the model's context is {MAX_POSITIONS} tokens (max_position_embeddings): shorten the prompt" in line
    )
    assert "raise" not in line
    ids = ",".join(["3"] * 100)
    line = one_line_error(capsys, "generate", str(ckpt), "--max-model-len", "64", "--prompt-token-ids", ids)
    assert f"raise --max-model-len to at least 100 (the model takes up to {MAX_POSITIONS})" in line


# -- JSON and files ---------------------------------------------------------------------------------
def test_at_dir_is_a_directory_not_a_missing_file(ckpt, tmp_path, capsys) -> None:
    line = one_line_error(capsys, "explain", str(ckpt), "--quantization-config", f"@{tmp_path}")
    assert f"@{tmp_path}: {tmp_path} is a directory; pass a JSON file" in line


def test_duplicate_json_keys_are_rejected(ckpt, capsys) -> None:
    q = '{"targets": {"re:.*kv_b_proj": "mxfp4", "re:.*kv_b_proj": "fp8_per_tensor"}}'
    line = one_line_error(capsys, "explain", str(ckpt), "--quantization-config", q)
    assert "duplicate key 're:.*kv_b_proj' in one JSON object" in line


def test_explain_says_weights_were_not_read_and_checks_them_on_request(ckpt, tmp_path, capsys) -> None:
    import shutil

    d = tmp_path / "nan"
    shutil.copytree(ckpt, d)
    tensors = read_tensors(d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    w = tensors[name].clone()
    w[0, 0] = float("nan")
    tensors[name] = w
    write_tensors(d, tensors)
    assert main(["explain", str(d)]) == 0
    assert "weights:     not read (explain reads config files only)" in capsys.readouterr().out
    assert main(["explain", str(d), "--check-weights"]) == 1
    assert "model.layers.0.self_attn.kv_b_proj: 1 NaN, 0 inf" in capsys.readouterr().out


@pytest.mark.parametrize("compile_flag", [[], ["--compile"]])
def test_compilation_config_errors_are_one_line(ckpt, capsys, compile_flag) -> None:
    """``--compilation-config`` without ``--compile``, or with a key mlaq cannot honour: one line, no
    traceback, saying what to pass."""
    bad = '{"inductor_compile_config": {"max_autotune": true}}' if not compile_flag else '{"level": 3}'
    line = one_line_error(
        capsys, "generate", str(ckpt), "--prompt-token-ids", "1", *compile_flag, "--compilation-config", bad
    )
    assert ("applies to compile=True" in line) if not compile_flag else ("'level'" in line), line
