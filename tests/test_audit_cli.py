"""``mlaq audit`` from the command line: reports, --suggest-config round trip through ``mlaq explain``,
and every bad input named in the issue as one clear line (exit 2, no traceback, nothing written)."""

from __future__ import annotations

import json
import shutil

import pytest

from audit_helpers import bf16_checkpoint, header_spans
from mlaq.outputs import MANIFEST, note_written
from model_helpers import edit_config

KV_B1 = "model.layers.1.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return bf16_checkpoint(tmp_path_factory.mktemp("audit_cli") / "bf16")


@pytest.fixture
def ckpt(pristine, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def test_report_files_and_suggested_config(ckpt, tmp_path, mlaq_cli):
    out = tmp_path / "out"
    res = mlaq_cli(
        "audit",
        str(ckpt),
        "--no-progress",
        "--out",
        str(out),
        "--suggest-config",
        "mxfp4",
        "--max-error",
        "100%",
    )
    assert res.returncode == 0, res.stderr
    assert "rank  layer" in res.stdout and "fp8_per_tensor W_UK" in res.stdout
    r = json.loads((out / "report.json").read_text())
    assert r["schemes"] == ["fp8_per_tensor", "mxfp4"] and len(r["layers"]) == 4
    assert "## Layers ranked by fp8_per_tensor" in (out / "report.md").read_text()
    assert (out / "error_by_layer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "quantization-config.json").read_text())
    assert set(config) == {"targets", "ignore"} and len(config["targets"]) == 4 and config["ignore"] == []
    # the suggestion is a config mlaq explain accepts, and it does what it says
    res = mlaq_cli(
        "explain", str(ckpt), "--json", "--quantization-config", f"@{out}/quantization-config.json"
    )
    assert res.returncode == 0, res.stderr
    layers = json.loads(res.stdout)["layers"]
    assert {(d["scheme"], d["rule"]) for d in layers} == {("mxfp4", "targets")}


def test_suggest_keeps_risky_layers_in_bf16(ckpt, mlaq_cli):
    res = mlaq_cli(
        "audit", str(ckpt), "--json", "--schemes", "mxfp4", "--suggest-config", "--max-error", "0.001"
    )
    assert res.returncode == 0, res.stderr
    sc = json.loads(res.stdout)["suggested_config"]
    assert sc["config"]["targets"] == {} and len(sc["config"]["ignore"]) == 4


def _fails(mlaq_cli, path, tmp_path, *extra):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    (out / "report.json").write_text("GOOD")
    note_written(out, ["report.json"])  # a report of an earlier run: mlaq may replace it, a failure must not
    res = mlaq_cli("audit", str(path), "--no-progress", "--out", str(out), *extra)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlaq audit: error: "), res.stderr
    assert "Traceback" not in res.stderr
    assert (out / "report.json").read_text() == "GOOD" and sorted(p.name for p in out.iterdir()) == [
        MANIFEST,
        "report.json",
    ]
    return lines[0]


def test_not_a_checkpoint(tmp_path, mlaq_cli):
    (tmp_path / "empty").mkdir()
    assert "no config.json" in _fails(mlaq_cli, tmp_path / "empty", tmp_path)
    assert "not a local directory; mlaq does not download" in _fails(mlaq_cli, tmp_path / "nope", tmp_path)


def test_no_weights(ckpt, tmp_path, mlaq_cli):
    for f in [*ckpt.glob("*.safetensors"), ckpt / "model.safetensors.index.json"]:
        f.unlink()
    assert "not a safetensors checkpoint" in _fails(mlaq_cli, ckpt, tmp_path)


def test_not_a_safetensors_file(ckpt, tmp_path, mlaq_cli):
    for f in [*ckpt.glob("*.safetensors"), ckpt / "model.safetensors.index.json"]:
        f.unlink()
    (ckpt / "model.safetensors").write_bytes(b"\xff" * 64)
    assert "model.safetensors: not a safetensors file" in _fails(mlaq_cli, ckpt, tmp_path)


def test_no_mla_layers(ckpt, tmp_path, mlaq_cli):
    edit_config(ckpt, kv_lora_rank=..., model_type="llama")
    assert "not a Multi-head Latent Attention model" in _fails(mlaq_cli, ckpt, tmp_path)


def test_kv_b_missing_from_the_index(ckpt, tmp_path, mlaq_cli):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    del index["weight_map"][KV_B1]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    assert f"tensor {KV_B1} is missing" in _fails(mlaq_cli, ckpt, tmp_path)


def test_kv_b_missing_in_the_shard_the_index_names(ckpt, tmp_path, mlaq_cli):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    here = index["weight_map"][KV_B1]
    index["weight_map"][KV_B1] = next(s for s in shards if s != here)
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert (
        index["weight_map"][KV_B1] in line and KV_B1 in line and "the index and the shards disagree" in line
    )


def test_missing_shard_names_file_and_tensor(ckpt, tmp_path, mlaq_cli):
    file = header_spans(ckpt)[KV_B1][0]
    file.unlink()
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert file.name in line and "shard missing" in line and "self_attn.kv_b_proj.weight'" in line


def test_truncated_shard_names_file_and_tensor(ckpt, tmp_path, mlaq_cli):
    file, start, end = header_spans(ckpt)[KV_B1]
    with open(file, "r+b") as f:
        f.truncate((start + end) // 2)
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert file.name in line and "truncated" in line and repr(KV_B1) in line


def test_truncated_header_names_file_and_tensor(ckpt, tmp_path, mlaq_cli):
    file = header_spans(ckpt)[KV_B1][0]
    with open(file, "r+b") as f:
        f.truncate(100)
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert file.name in line and "truncated" in line and "self_attn.kv_b_proj.weight'" in line


def test_unsupported_stored_format(ckpt, tmp_path, mlaq_cli):
    """A ModelOpt NVFP4 checkpoint that quantizes attention: mlaq cannot decode NVFP4."""
    (ckpt / "hf_quant_config.json").write_text(
        json.dumps(
            {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16}}
        )
    )
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert "stored as nvfp4" in line and "cannot decode" in line


def test_stored_dtype_the_loader_rejects(ckpt, tmp_path, mlaq_cli):
    from model_helpers import read_tensors, write_tensors

    tensors = read_tensors(ckpt)
    tensors[KV_B1] = tensors[KV_B1].double()
    write_tensors(ckpt, tensors, shards=2)
    line = _fails(mlaq_cli, ckpt, tmp_path)
    assert KV_B1 in line and "dtype float64 is not allowed" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--schemes", "fp9"), "unknown BMM scheme 'fp9'"),
        (("--suggest-config", "mxfp4"), "--suggest-config and --max-error go together"),
        (("--suggest-config", "--max-error", "lots"), "is not a number"),
        (("--workers", "0"), "--workers must be at least 1"),
    ],
)
def test_bad_arguments(ckpt, tmp_path, mlaq_cli, args, message):
    assert message in _fails(mlaq_cli, ckpt, tmp_path, *args)
