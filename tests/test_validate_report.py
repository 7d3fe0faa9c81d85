"""Report writers: files, strict JSON, Markdown content, atomic replacement, the terminal table."""

from __future__ import annotations

import io
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from mlaq.validate import report as report_mod
from mlaq.validate.config import ValidateConfig
from mlaq.validate.report import REPORT_JSON, REPORT_MD, write_report
from mlaq.validate.runner import run_validation
from mlaq.validate.summary import format_markdown, format_plain, print_summary
from validate_helpers import tiny_checkpoint


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("tiny_report"))
    cfg = ValidateConfig(
        model=ckpt,
        eval_text=ckpt / "heldout.txt",
        schemes=("mxfp4", "fp8_per_block"),
        context_len=48,
        windows=1,
        buckets=3,
        prompts=2,
        prompt_len=12,
        max_tokens=6,
        num_speculative_tokens=2,
    )
    return run_validation(cfg)


def test_write_report_files(report, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = write_report(report, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == sorted(
        [
            "report.md",
            "report.json",
            "error_vs_position.png",
            "acceptance_per_position.png",
            "per_layer_error.png",
        ]
    )
    for p in paths:
        assert p.stat().st_size > 0
    assert json.loads((tmp_path / "out" / REPORT_JSON).read_text()) == json.loads(json.dumps(report))
    png = (tmp_path / "out" / "per_layer_error.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temp dir left


def test_markdown_states_model_text_seed_versions_arithmetic_theory(report) -> None:
    from mlaq.validate.report_md import render_markdown

    md = render_markdown(report, [])
    for text in (
        report["model"]["path"],
        report["eval_text"]["sha256"][:16],
        "**Seed**: 0",
        f"torch {torch.__version__}",
        report["schemes"]["mxfp4"]["schemes"]["mxfp4"],  # the exact arithmetic
        "W4A4 MXFP4 ≈ 15.8 %",
        "| mxfp4 |",
        "## MTP speculative decoding",
        "2 (MTP)",
    ):
        assert text in md, text


def test_a_failing_write_leaves_the_previous_report(report, tmp_path, monkeypatch) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / REPORT_MD).write_text("good old report")
    (out / REPORT_JSON).write_text('{"good": true}')

    def broken(*_args, **_kwargs):
        raise RuntimeError("disk full while rendering")

    monkeypatch.setattr(report_mod, "render_markdown", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(report, out, plots=False)
    assert (out / REPORT_MD).read_text() == "good old report"
    assert (out / REPORT_JSON).read_text() == '{"good": true}'
    assert sorted(p.name for p in out.iterdir()) == [REPORT_JSON, REPORT_MD]  # temp dir removed


def test_nan_is_never_written(report, tmp_path) -> None:
    bad = json.loads(json.dumps(report))
    bad["schemes"]["mxfp4"]["kl"] = float("nan")
    with pytest.raises(ValueError):
        write_report(bad, tmp_path / "out", plots=False)
    assert not (tmp_path / "out" / REPORT_JSON).exists()


def test_out_must_be_a_directory(report, tmp_path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        write_report(report, f)


def test_summary_tables(report) -> None:
    plain = format_plain(report)
    lines = plain.splitlines()
    assert lines[0].split()[0] == "scheme" and len(lines) == 2 + 4  # header, rule, ref, floor, 2 schemes
    assert lines[2].startswith("bf16 (reference)") and lines[3].startswith("fp32 (noise floor)")
    md = format_markdown(report)
    assert md.count("\n") == 5 and "| mxfp4 |" in md
    buf = io.StringIO()
    print_summary(report, buf, use_rich=False)
    assert "fp8_per_block" in buf.getvalue()
    pytest.importorskip("rich")
    buf = io.StringIO()
    print_summary(report, buf)
    assert "noise floor" in buf.getvalue() and "mxfp4" in buf.getvalue()
