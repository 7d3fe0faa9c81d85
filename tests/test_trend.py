"""mlaq.validate.trend: does a scheme's paired drop grow with length (slope per doubling, longest minus
shortest, stratified bootstrap intervals), and its wiring into the report."""

from __future__ import annotations

import numpy as np
import pytest

from mlaq.validate.trend import length_trend, ols_slope

LENGTHS = (1024, 2048, 4096, 8192, 16384)


def test_slope_is_numpy_polyfit_on_log2_length_and_difference_is_the_cell_means():
    rng = np.random.default_rng(0)
    drops = {n: rng.normal(0.01 * i, 0.1, size=7 + i).tolist() for i, n in enumerate(LENGTHS)}
    t = length_trend(drops, unit="nats", resamples=200)
    x = np.concatenate([np.full(len(d), np.log2(n)) for n, d in drops.items()])
    y = np.concatenate([d for d in drops.values()])
    assert t.slope == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-12)
    assert ols_slope(x, y) == pytest.approx(np.polyfit(x, y, 1)[0], rel=1e-12)
    assert t.difference == pytest.approx(np.mean(drops[16384]) - np.mean(drops[1024]), rel=1e-12)
    assert t.n == tuple(len(drops[n]) for n in LENGTHS) and t.lengths == LENGTHS
    assert t.slope_ci[0] <= t.slope <= t.slope_ci[1]


def test_a_growing_accuracy_drop_is_seen_growing():
    """bf16 right everywhere; the scheme loses 0 %, 10 %, 20 %, 30 %, 40 % of 60 samples per length."""
    drops = {n: [1.0] * (6 * i) + [0.0] * (60 - 6 * i) for i, n in enumerate(LENGTHS)}
    t = length_trend(drops)
    assert t.slope == pytest.approx(0.10) and t.difference == pytest.approx(0.40)
    assert t.slope_ci[0] > 0 and t.difference_ci[0] > 0
    assert t.answer.startswith("The drop grows with length: +10.0 pts per doubling")


def test_a_flat_drop_shows_no_trend_and_says_what_is_ruled_out():
    """The same 10 % drop at every length (the samples in another order): slope 0, interval around it."""
    rng = np.random.default_rng(1)
    drops = {n: rng.permutation([1.0] * 6 + [0.0] * 54).tolist() for n in LENGTHS}
    t = length_trend(drops)
    assert t.slope == pytest.approx(0.0, abs=1e-12) and t.difference == pytest.approx(0.0, abs=1e-12)
    assert t.slope_ci[0] < 0 < t.slope_ci[1]
    assert t.answer.startswith("No trend with length was seen: +0.0 pts per doubling")
    assert f"a growth above {100 * t.slope_ci[1]:+.1f} pts per doubling is ruled out" in t.answer
    shrink = length_trend({n: [0.4 - 0.1 * i] * 20 for i, n in enumerate(LENGTHS)})
    assert shrink.answer.startswith("The drop shrinks with length")


def test_identical_drops_bound_nothing():
    """No sample changed its answer at any length: the bootstrap interval is a point, not evidence."""
    t = length_trend({n: [0.0, 0.0] for n in LENGTHS})
    assert t.slope_ci == (0.0, 0.0)
    assert t.answer.startswith("No trend with length was seen, and none can be bounded")
    assert "ruled out" not in t.answer


def test_interval_covers_the_true_slope_about_95_percent_of_the_time():
    """Normal drops with a known slope of 0.05 per doubling, 30 samples per length, 200 runs."""
    rng = np.random.default_rng(2)
    hits = 0
    for run in range(200):
        drops = {n: rng.normal(0.05 * i, 0.3, size=30) for i, n in enumerate(LENGTHS)}
        lo, hi = length_trend(drops, resamples=400, seed=run).slope_ci
        hits += lo <= 0.05 <= hi
    assert 0.88 <= hits / 200 <= 0.99, hits


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="at least 2 lengths"):
        length_trend({1024: [0.0, 1.0]})
    with pytest.raises(ValueError, match="at least one paired sample"):
        length_trend({1024: [0.0], 2048: []})


def test_report_carries_the_trend_per_scheme_and_task():
    """The hand-built record: mxfp4 loses needle on 2 of 4 samples at 1024 only (none at 512)."""
    from mlaq.validate.report_md import render_markdown
    from test_validate_report import _hand_report

    r = _hand_report()
    needle = r["schemes"]["mxfp4"]["length_trend"]["needle"]
    assert needle["accuracy"]["longest_minus_shortest"] == pytest.approx(0.5)
    assert needle["accuracy"]["slope_per_doubling"] == pytest.approx(0.5)  # one doubling, 0 -> 50 %
    assert needle["logprob"]["slope_per_doubling"] == pytest.approx(0.1)
    assert "length_trend" not in r["reference"]
    md = render_markdown(r, [])
    assert "### does the drop grow with length?" in md
    assert "| mxfp4 | needle | accuracy | 4/4 | +50.0 pts [" in md
    # 2 of 4 samples: the interval reaches 0, so the report does not claim growth
    assert "- mxfp4, needle accuracy: No trend with length was seen: +50.0 pts per doubling" in md
