"""bench/evidence_table.py renders a report's task cells, needle depths and length trend without loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("evidence_table", ROOT / "bench/evidence_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cell(acc: float, delta: float, lp: float) -> dict:
    return {
        "accuracy": acc, "ci_low": acc - 0.1, "ci_high": min(1.0, acc + 0.05), "n": 50,
        "accuracy_delta": delta, "p_value_vs_bf16": 0.5, "logprob_delta": lp, "logprob_delta_ci": [lp - 0.01, lp + 0.01],
    }  # fmt: skip


def _trend(unit: str, slope: float) -> dict:
    return {
        "slope_per_doubling": slope, "slope_ci": [slope - 0.001, slope + 0.002], "longest_minus_shortest": 2 * slope,
        "longest_minus_shortest_ci": [0.0, 4 * slope], "unit": unit,
    }  # fmt: skip


def _report() -> dict:
    lengths = ("1024", "16384")
    ref = {"needle": {n: _cell(0.92, 0, 0) for n in lengths}}
    depth = {"0": {"accuracy": 0.7, "n": 10}, "1": {"accuracy": 1.0, "n": 10}}
    scheme = {
        "tasks": {"needle": {"1024": _cell(0.9, -0.02, -0.004), "16384": _cell(0.86, -0.06, -0.0123)}},
        "length_trend": {"needle": {"accuracy": _trend("pts", 0.012), "logprob": _trend("nats", 0.0015)}},
    }
    return {
        "reference": {"tasks": ref, "needle_by_depth": {n: depth for n in lengths}},
        "schemes": {"mxfp4": scheme},
    }


def test_by_length_tables_carry_every_cell():
    m = _module()
    rows = m.by_length_rows(_report())
    assert "| scheme | 1024 | 16384 |" in rows
    assert "| bf16 | 92 % [82 %, 97 %] n=50 | 92 % [82 %, 97 %] n=50 |" in rows
    mx = next(r for r in rows if r.startswith("| mxfp4 |"))
    assert "-2 pts (p 0.5); -0.004 [-0.014, +0.006]" in mx and "-6 pts (p 0.5); -0.012 [-0.022, -0.002]" in mx


def test_depth_and_trend_rows():
    m = _module()
    depth = m.depth_rows(_report())
    assert depth[0] == "| length | depth 0 | depth 1 |" and "| 16384 | 70 % (10) | 100 % (10) |" in depth
    trend = m.trend_rows(_report())
    assert (
        trend[-1]
        == "| mxfp4 | needle | +1.2 [+1.1, +1.4] | +2.4 [+0.0, +4.8] | +0.0015 [+0.0005, +0.0035] | +0.0030 [+0.0000, +0.0060] |"
    )
    assert m.trend_rows({"schemes": {"fp8": {}}}) == []  # one length: no trend table
