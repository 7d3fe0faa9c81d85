"""``mlaq validate`` through the command line (subprocesses against the mlaq under test)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import MAX_POSITIONS, PER_SCHEME, tiny_checkpoint

SMALL = [
    "--context-len", "48", "--windows", "1", "--buckets", "3", "--prompts", "2",
    "--prompt-len", "12", "--max-tokens", "6", "--num-speculative-tokens", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_cli"))


def test_end_to_end_with_out_and_json(mlaq_cli, checkpoint, tmp_path) -> None:
    out = tmp_path / "report"
    args = ["validate", str(checkpoint), "--schemes", "mxfp4,fp8_per_tensor", *SMALL]
    res = mlaq_cli(*args, "--out", str(out), "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)  # exactly one JSON object, nothing else on stdout
    assert set(report["schemes"]) == {"mxfp4", "fp8_per_tensor"}
    for key in PER_SCHEME:
        assert isinstance(report["schemes"]["mxfp4"][key], float)
    assert report["reference"]["acceptance_rate"] is not None and report["noise_floor"]["kl"] >= 0
    names = {p.name for p in out.iterdir()}
    assert {"report.md", "report.json"} <= names
    if pytest.importorskip("matplotlib"):
        assert {"error_vs_position.png", "acceptance_per_position.png", "per_layer_error.png"} <= names
    assert json.loads((out / "report.json").read_text())["schemes"].keys() == report["schemes"].keys()


def test_table_and_progress(mlaq_cli, checkpoint) -> None:
    res = mlaq_cli("validate", str(checkpoint), "--schemes", "mxfp4", *SMALL)
    assert res.returncode == 0, res.stderr
    assert "bf16 (reference)" in res.stdout and "mxfp4" in res.stdout and "noise floor" in res.stdout
    assert "validate" in res.stderr  # progress goes to stderr


def test_hopper_schemes_run_end_to_end(mlaq_cli, checkpoint) -> None:
    """The _sm90 schemes (Hopper's tensor-core sums) through the whole run, with their base scheme's theory."""
    res = mlaq_cli("validate", str(checkpoint), "--schemes", "fp8_per_block_sm90,bf16_sm90", *SMALL, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert set(report["schemes"]) == {"fp8_per_block_sm90", "bf16_sm90"}
    fp8 = report["schemes"]["fp8_per_block_sm90"]
    assert all(isinstance(fp8[key], float) for key in PER_SCHEME)
    assert fp8["theory_bmm_rel_err"] > 0.03  # fp8_per_block's Gaussian figure, not missing


def test_unknown_scheme_lists_the_known_ones(mlaq_cli, checkpoint) -> None:
    res = mlaq_cli("validate", str(checkpoint), "--schemes", "mxfp5")
    assert res.returncode == 2
    assert (
        "unknown scheme 'mxfp5'" in res.stderr
        and "mxfp4_w4a16" in res.stderr
        and "fp8_per_block" in res.stderr
    )


def test_missing_eval_text(mlaq_cli, checkpoint, tmp_path) -> None:
    res = mlaq_cli("validate", str(checkpoint), "--eval-text", str(tmp_path / "nope.txt"))
    assert res.returncode == 2 and "nope.txt" in res.stderr and "no such file" in res.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (bare / name).write_bytes((checkpoint / name).read_bytes())
    res = mlaq_cli("validate", str(bare))
    assert res.returncode == 2 and "heldout.txt" in res.stderr and "--eval-text" in res.stderr


def test_context_longer_than_the_model(mlaq_cli, checkpoint) -> None:
    res = mlaq_cli("validate", str(checkpoint), "--context-len", str(MAX_POSITIONS + 1))
    assert res.returncode == 2
    assert f"max_position_embeddings {MAX_POSITIONS}" in res.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--windows", "0"], "windows must be at least 1"),
        (["--num-speculative-tokens", "-1"], "num_speculative_tokens must be >= 0"),
        (["--context-len", "32", "--prompt-len", "30"], "do not fit the context"),
        (["--context-len", "4000"], "exceeds the model's max_position_embeddings"),
        (["--as-configured", "--quantization-config", "{bad"], "not valid JSON"),
        (["--schemes", "mxfp4", "mxfp4"], "listed twice"),
        (["--quantization-config", '{"targets": {"re:.*o_proj": "mxfp4"}}'], "kv_b_proj"),
        (["--threads", "-1"], "--threads must be >= 0"),
    ],
)
def test_bad_inputs_are_clear_errors(checkpoint, args, message, capsys) -> None:
    from mlaq.cli import main

    assert main(["validate", str(checkpoint), "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mlaq validate: error: ") and message in err, err


def test_not_a_checkpoint(mlaq_cli, tmp_path) -> None:
    res = mlaq_cli("validate", str(tmp_path))
    assert res.returncode == 2 and "no config.json" in res.stderr


def test_bundled_model_missing_is_a_clear_error(monkeypatch, tmp_path) -> None:
    from mlaq import bundled

    monkeypatch.setattr(bundled.resources, "files", lambda _pkg: tmp_path)
    with pytest.raises(
        FileNotFoundError, match=r"mlaq-tiny-4k is not installed.*pass a checkpoint directory"
    ):
        bundled.bundled_model_dir()


def _bundled_or_skip():
    from mlaq.bundled import bundled_model_dir

    try:
        return bundled_model_dir()
    except FileNotFoundError:
        pytest.skip("the bundled mlaq-tiny-4k asset is not in this checkout")


def test_bundled_model_smoke(mlaq_cli) -> None:
    """With no MODEL the bundled mlaq-tiny-4k and its held-out code are used (a small, fast run)."""
    asset = _bundled_or_skip()
    args = ["--context-len", "256", "--windows", "1", "--prompts", "1", "--prompt-len", "64"]
    args += ["--tasks", "needle", "--lengths", "512", "--task-samples", "1", "--flip-rows", "32"]
    res = mlaq_cli("validate", "--schemes", "mxfp4", *args, "--max-tokens", "8", "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["model"]["path"] == str(asset) and report["eval_text"]["path"].endswith("heldout.txt")
    m = report["model"]
    assert m["num_mtp_layers"] == 1 and m["kv_lora_rank"] == 512 and m["max_position_embeddings"] >= 4096
    assert report["schemes"]["mxfp4"]["attn_rel_err"] > report["noise_floor"]["attn_rel_err"]


def test_bundled_model_on_its_prose_heldout(mlaq_cli) -> None:
    """--eval-text with the second held-out source shipped beside the default model (English prose)."""
    prose = _bundled_or_skip() / "heldout-prose.txt"
    args = [
        "--context-len",
        "128",
        "--windows",
        "1",
        "--prompts",
        "1",
        "--prompt-len",
        "32",
        "--max-tokens",
        "4",
    ]
    args += ["--tasks", "none", "--num-speculative-tokens", "0", "--flip-rows", "16", "--schemes", "mxfp4"]
    res = mlaq_cli("validate", "--eval-text", str(prose), *args, "--json", "--no-progress")
    assert res.returncode == 0, res.stderr
    e = json.loads(res.stdout)["eval_text"]
    assert e["path"] == str(prose) and e["tokens"] > 50_000


def test_as_configured_reads_the_settings_from_the_environment(mlaq_cli, checkpoint) -> None:
    res = mlaq_cli(
        "validate",
        str(checkpoint),
        "--as-configured",
        *SMALL,
        "--json",
        "--no-progress",
        env={"MLAQ_FP4BMM": "1"},
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["schemes"] == {}  # --as-configured alone: no default scheme list
    ac = report["as_configured"]
    assert {(d["scheme"], d["rule"]) for d in ac["decisions"]} == {("mxfp4", "flag")}
    assert report["config"]["settings"] == {"MLAQ_FP8BMM": False, "MLAQ_FP4BMM": True}
    assert ac["attn_rel_err"] > 0.05 and ac["schemes"] == {"mxfp4": ac["schemes"]["mxfp4"]}
