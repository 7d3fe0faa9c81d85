"""Wilson, exact McNemar, the paired bootstrap and the detectable drop against independent values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlaq.validate.intervals import (
    exact_floor,
    mcnemar_exact,
    min_detectable_drop,
    paired_bootstrap,
    paired_ratio_bootstrap,
    wilson,
)


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [  # published Wilson 95 % intervals (Newcombe 1998, Table I; Brown, Cai & DasGupta 2001)
        (8, 10, 0.4902, 0.9433),
        (5, 10, 0.2366, 0.7634),
        (0, 10, 0.0, 0.2775),
        (10, 10, 0.7225, 1.0),
        (81, 263, 0.2553, 0.3662),
    ],
)
def test_wilson_matches_published_values(k, n, low, high) -> None:
    lo, hi = wilson(k, n)
    assert lo == pytest.approx(low, abs=6e-5) and hi == pytest.approx(high, abs=6e-5)


@pytest.mark.parametrize(
    ("b", "c", "p"),
    [  # 2 * sum_{i <= min} C(b + c, i) / 2^(b + c), by hand
        (1, 9, 2 * (1 + 10) / 1024),
        (0, 6, 2 / 64),
        (0, 5, 2 / 32),
        (3, 3, 1.0),
        (0, 0, 1.0),
        (2, 8, 2 * (1 + 10 + 45) / 1024),
    ],
)
def test_mcnemar_exact_by_hand(b, c, p) -> None:
    assert mcnemar_exact(b, c) == pytest.approx(p, rel=1e-12)
    assert mcnemar_exact(c, b) == pytest.approx(p, rel=1e-12)


def test_against_scipy_when_installed() -> None:
    stats = pytest.importorskip("scipy.stats")
    for b, c in [(4, 17), (30, 12), (100, 131)]:
        assert mcnemar_exact(b, c) == pytest.approx(stats.binomtest(min(b, c), b + c, 0.5).pvalue, rel=1e-9)
    for k, n in [(3, 17), (90, 100)]:
        ci = stats.binomtest(k, n).proportion_ci(method="wilson")
        assert wilson(k, n) == pytest.approx((ci.low, ci.high), rel=1e-9)


def test_large_counts_do_not_underflow() -> None:
    assert 0 < mcnemar_exact(400, 600) < 1e-9


def test_bootstrap() -> None:
    assert paired_bootstrap([0.25] * 7) == (0.25, 0.25)
    rng = np.random.default_rng(1)
    d = rng.normal(0.5, 1.0, 400)
    low, high = paired_bootstrap(d, seed=3)
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)  # the normal-theory interval, for comparison
    assert low == pytest.approx(d.mean() - half, abs=0.15 * half)
    assert high == pytest.approx(d.mean() + half, abs=0.15 * half)
    assert paired_bootstrap(d, seed=3) == (low, high)  # deterministic by seed


def test_detectable_drop() -> None:
    assert exact_floor(0.05) == 6  # 2 / 2^5 = 0.0625 is not significant, 2 / 2^6 = 0.03125 is
    # (1.95996 + 0.84162) * sqrt(2 * 0.9 * 0.1 / 1000) = 0.037587
    assert min_detectable_drop(1000, 0.9) == pytest.approx(0.037587, abs=1e-5)
    assert min_detectable_drop(20, 0.9) == pytest.approx(6 / 20)  # the exact floor binds
    assert min_detectable_drop(3, 0.5) == 1.0  # nothing detectable


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: wilson(1, 0), "at least one sample"),
        (lambda: wilson(5, 4), "successes must be in 0..4"),
        (lambda: paired_bootstrap([]), "at least one paired difference"),
        (lambda: mcnemar_exact(-1, 2), ">= 0"),
    ],
)
def test_bad_inputs(call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_ratio_bootstrap_pairs_the_prompts() -> None:
    """Each prompt's acceptance scaled by exactly 0.8 gives 0.8 in every resample (pairing), though the
    prompts' rates range from 10 % to 90 % (unpaired, the interval would be wide)."""
    ref = [(100, 10), (100, 90), (50, 25), (200, 100), (100, 40)]
    cand = [(d, a * 4 // 5) for d, a in ref]
    assert paired_ratio_bootstrap(ref, cand) == pytest.approx((0.8, 0.8))
    assert paired_ratio_bootstrap(ref, ref) == pytest.approx((1.0, 1.0))
    assert paired_ratio_bootstrap(ref, [(d, 0) for d, _ in ref]) == (0.0, 0.0)  # a collapse


def test_ratio_bootstrap_against_a_loop() -> None:
    rng = np.random.default_rng(7)
    ref = [(int(d), int(rng.integers(0, d + 1))) for d in rng.integers(20, 80, size=8)]
    cand = [(int(d), int(rng.integers(0, d + 1))) for d in rng.integers(20, 80, size=8)]
    low, high = paired_ratio_bootstrap(ref, cand, resamples=2000, seed=11)
    idx = np.random.default_rng(11).integers(0, 8, size=(2000, 8))
    ratios = []
    for row in idx:
        r = [ref[i] for i in row]
        c = [cand[i] for i in row]
        ratios.append(
            (sum(a for _, a in c) / sum(d for d, _ in c)) / (sum(a for _, a in r) / sum(d for d, _ in r))
        )
    assert (low, high) == pytest.approx(tuple(np.quantile(ratios, [0.025, 0.975])))
    point = (sum(a for _, a in cand) / sum(d for d, _ in cand)) / (
        sum(a for _, a in ref) / sum(d for d, _ in ref)
    )
    assert low < point < high


def test_ratio_bootstrap_refuses_what_it_cannot_pair() -> None:
    assert paired_ratio_bootstrap([(10, 0)] * 4, [(10, 5)] * 4) is None  # the reference never accepts
    with pytest.raises(ValueError, match="same units"):
        paired_ratio_bootstrap([(10, 5)] * 3, [(10, 5)] * 4)
