"""Report writers: files, strict JSON, Markdown content, atomic replacement, the terminal table."""

from __future__ import annotations

import io
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from mlaq.outputs import MANIFEST, note_written
from mlaq.validate import report as report_mod
from mlaq.validate.report import REPORT_JSON, REPORT_MD, write_report
from mlaq.validate.runner import run_validation
from mlaq.validate.summary import format_markdown, format_plain, print_summary
from mlaq.validate.tasks.spec import TaskConfig
from validate_helpers import local_config, tiny_checkpoint


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    ckpt = tiny_checkpoint(tmp_path_factory.mktemp("tiny_report"))
    cfg = local_config(
        ckpt,
        schemes=("mxfp4", "fp8_per_block"),
        context_len=48,
        windows=1,
        buckets=3,
        prompts=2,
        prompt_len=12,
        max_tokens=6,
        num_speculative_tokens=2,
        tasks=TaskConfig(tasks=("needle",), lengths=(160, 240), samples=2, depths=(0.0, 1.0)),
        flip_rows=16,
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
            "task_accuracy.png",
            "task_logprob_delta.png",
            "needle_depth_length.png",
            "flip_rate_vs_keys.png",
        ]
    )
    for p in paths:
        assert p.stat().st_size > 0
    assert json.loads((tmp_path / "out" / REPORT_JSON).read_text()) == report.to_json()
    png = (tmp_path / "out" / "per_layer_error.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    left = [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]
    assert left == [".mlaq-outputs.json"]  # no temp dir left; the manifest of what mlaq wrote


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
    note_written(out, [REPORT_MD, REPORT_JSON])  # mlaq's report of an earlier run

    def broken(*_args, **_kwargs):
        raise RuntimeError("disk full while rendering")

    monkeypatch.setattr(report_mod, "render_markdown", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        write_report(report, out, plots=False)
    assert (out / REPORT_MD).read_text() == "good old report"
    assert (out / REPORT_JSON).read_text() == '{"good": true}'
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, REPORT_JSON, REPORT_MD]  # temp dir removed


def test_nan_is_never_written(report, tmp_path) -> None:
    bad = report.to_json()
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


def test_engine_report_renders_verdict_tasks_and_flips(report) -> None:
    """A real run with the task suite: report.md carries the verdict, the task tables (needle by depth
    included) and the flip-rate section; --json carries issue 14's keys; the table one column per task."""
    from mlaq.validate.report_md import render_markdown

    md = render_markdown(report, [])
    for text in ("## Verdict", "## Long-context tasks", "### needle", "### needle by depth", "| 240 |"):
        assert text in md, text
    assert "## Attention flip rate" in md and "| 0 | retrieval flip |" in md
    cell = report["schemes"]["mxfp4"]["tasks"]["needle"]["240"]
    keys = {"accuracy", "ci_low", "ci_high", "n", "p_value_vs_bf16", "logprob_delta", "logprob_delta_ci"}
    assert keys <= set(cell) and cell["n"] == 2
    assert {"accuracy", "ci_low", "ci_high", "n"} <= set(report["reference"]["tasks"]["needle"]["160"])
    assert set(report["schemes"]["mxfp4"]["flip_rate"]["0"]) == {str(b[1]) for b in report["buckets"]}
    head = format_plain(report).splitlines()[0]
    assert head.split()[-5:] == ["len", "needle", "@240", "verdict", "MDE"]


def _hand_report():
    """A hand-built record with two tasks x two lengths and one layer's flips: known figures."""
    from dataclasses import replace

    from mlaq.validate.record import TaskSampleRecord, TaskScoreRecord, TaskSuiteRecord, Totals
    from mlaq.validate.stats import summarize
    from test_validate_record import hand_record

    rec = hand_record()
    samples = [
        TaskSampleRecord(task, length, i, float(i % 2), 3, False)
        for task in ("needle", "copy")
        for length in (512, 1024)
        for i in range(4)
    ]
    config = {"tasks": ["needle", "copy"], "lengths": [512, 1024], "samples": 4, "depths": [0.0, 1.0]}
    suite = TaskSuiteRecord(
        {**config, "seed": 0, "skipped": []}, {"path": "h.txt", "tokens": 900, "wrapped": True}, samples, 2.0
    )
    ref_scores = [TaskScoreRecord(True, -0.5, 1.0) for _ in samples]
    # mxfp4 misses needle at 1024 on samples 0 and 2 (depth 0) and is less sure of every answer there
    cand_scores = [
        TaskScoreRecord(
            not (s.task == "needle" and s.length == 1024 and s.index % 2 == 0),
            -0.5 - 0.1 * (s.length == 1024),
            1.0,
        )
        for s in samples
    ]
    flips = {
        "flip/0": Totals([[1.0, 3.0], [1.0, 5.0]], [[10, 10], [10, 10]]),
        "flip_retrieval/0": Totals([[0.0, 1.0], [0.0, 1.0]], [[2, 4], [2, 4]]),
        "tv/0": Totals([[0.02, 0.08], [0.02, 0.08]], [[10, 10], [10, 10]]),
    }
    cand = rec.candidates[0]
    cand = replace(cand, tasks=cand_scores, positions={**cand.positions, **flips})
    rec = replace(rec, tasks=suite, reference=replace(rec.reference, tasks=ref_scores), candidates=[cand])
    return summarize(rec)


def test_hand_report_tables_have_the_figures() -> None:
    from mlaq.validate.report_md import render_markdown

    r = _hand_report()
    md = render_markdown(r, [])
    # verdict: mean KL 1.0 nats > 0.01 -> degraded, with its reason; the smallest detectable drop stated
    assert "| mxfp4 | **degraded** |" in md and "mean KL 1.00e+00 nats > 0.01" in md
    mde = r["schemes"]["mxfp4"]["verdict"]["min_detectable_drop"]
    assert f"| mxfp4 | **degraded** | {100 * mde:.0f} % |" in md
    # task table: accuracy with Wilson interval and n, McNemar p (2 discordant pairs -> exact p 0.5), Δ log-prob
    assert "| bf16 (reference) | 1024 | 4 | 100 % [51 %–100 %] | — | — | -0.500 | — |" in md
    assert "| mxfp4 | 1024 | 4 | 50 % [15 %–85 %] | -50 pts | 0.5 | -0.600 | -0.100 [-0.100, -0.100] |" in md
    assert "| mxfp4 | 512 | 4 | 100 % [51 %–100 %] | +0 pts | 1 | -0.500 | +0.000 [+0.000, +0.000] |" in md
    assert "(repeated to fill the longest samples)" in md and "### copy" in md
    # needle by depth x length: depth 0 lost at 1024, depth 1 kept
    assert "| 1024 | 0 % (2) | 100 % (2) |" in md
    # flips: pooled over the two windows per bucket of competing keys
    assert "| 0 | flip | 10.00 % | 40.00 % |" in md
    assert "| 0 | retrieval flip | 0.00 % (4) | 25.00 % (8) |" in md
    assert "| 0 | TV | 2.00e-03 | 8.00e-03 |" in md and "≤ 8 keys" in md
    plain = format_plain(r).splitlines()
    assert plain[0].split()[-6:] == ["needle", "@1024", "copy", "@1024", "verdict", "MDE"]
    assert plain[2].split()[-6:] == ["100", "%", "100", "%", "—", "—"]  # bf16: needle, copy at 1024
    assert plain[3].split()[-3:] == ["degraded", f"{100 * mde:.0f}", "pts"] and " 50 % " in plain[3]  # mxfp4
    # the terminal output ends with one line per scheme: its verdict and why
    out = io.StringIO()
    print_summary(r, out, use_rich=False)
    assert "mxfp4: degraded — mean KL 1.00e+00 nats > 0.01" in out.getvalue()


def test_task_plots_from_the_hand_report(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from mlaq.validate.plots import write_plots

    names = write_plots(_hand_report(), tmp_path)
    new = ["task_accuracy.png", "task_logprob_delta.png", "needle_depth_length.png", "flip_rate_vs_keys.png"]
    assert names[-4:] == new
    for name in new:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
