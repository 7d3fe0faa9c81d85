"""``--tensor-parallel-size`` through ``mlaq explain`` and ``mlaq validate`` (subprocesses)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import tiny_checkpoint

FP8 = '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'
SMALL = [
    "--context-len", "48", "--windows", "1", "--buckets", "3", "--prompts", "2",
    "--prompt-len", "12", "--max-tokens", "6", "--num-speculative-tokens", "0", "--flip-rows", "0",
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_tp"))


def test_explain_names_the_ranks_and_the_per_shard_layers(mlaq_cli) -> None:
    res = mlaq_cli("explain", "--tensor-parallel-size", "2", "--quantization-config", FP8)
    assert res.returncode == 0, res.stderr
    assert "tensor parallel: 2 ranks (rank 0: heads [0, 2), rank 1: heads [2, 4);" in res.stdout
    assert "per-tensor scales are computed per shard" in res.stdout
    assert "per-shard scales: layers 0-4 (2 scales per BMM weight instead of one)" in res.stdout
    mx = mlaq_cli("explain", "-tp", "4", "--quantization-config", FP8.replace("fp8_per_tensor", "mxfp4"))
    assert "per-shard scales: no layer's scheme has a scale spanning heads" in mx.stdout
    js = json.loads(mlaq_cli("explain", "-tp", "2", "--json").stdout)
    assert js["tensor_parallel_size"] == 2
    plain = mlaq_cli("explain")
    assert "tensor parallel" not in plain.stdout


def test_explain_refuses_a_size_not_dividing_the_heads(mlaq_cli) -> None:
    res = mlaq_cli("explain", "--tensor-parallel-size", "3")
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "mlaq explain: error: Total number of attention heads (4) must be divisible by tensor parallel size (3)."
    ]


def test_validate_reports_the_size(mlaq_cli, checkpoint, tmp_path) -> None:
    out = tmp_path / "r"
    res = mlaq_cli(
        "validate", str(checkpoint), "--schemes", "fp8_per_tensor", "-tp", "2", *SMALL,
        "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["tensor_parallel_size"] == 2
    # the run's caption (terminal table and report.md)
    assert "tensor parallel 2 (BMM scales per rank's shard of the heads)" in (out / "report.md").read_text()
    assert "tensor parallel 2" in " ".join(res.stdout.split())


def test_validate_refuses_it_with_a_server(mlaq_cli) -> None:
    res = mlaq_cli("validate", "--server", "http://127.0.0.1:9", "-tp", "2")
    assert res.returncode != 0
    assert "--tensor-parallel-size is for local validation" in res.stderr
