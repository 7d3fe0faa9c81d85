"""Interval estimates and paired tests for the task suite, as pure functions (no SciPy needed).

- ``wilson``: the Wilson score interval of a binomial proportion (Wilson 1927), which keeps its
  coverage near 0 and 1 where the normal ("Wald") interval collapses to a point;
- ``mcnemar_exact``: the exact (binomial) McNemar test on paired right/wrong outcomes: under the null
  the discordant pairs split 50/50, two-sided p = min(1, 2 P[Bin(b + c, 1/2) <= min(b, c)]);
- ``paired_bootstrap``: the percentile interval of the mean of paired differences, resampling pairs;
- ``min_detectable_drop``: the smallest accuracy drop a run of n paired samples could detect
  (alpha 0.05 two-sided, power 0.8), so "no difference" is never claimed beyond what was measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # standard normal quantile 0.975
Z80 = 0.8416212335729143  # standard normal quantile 0.8 (power 0.8)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval (low, high) for ``successes`` out of ``n`` (n >= 1)."""
    if n < 1:
        raise ValueError(f"a proportion needs at least one sample, got n={n}")
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in 0..{n}, got {successes}")
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # clamp the rounding of the exact endpoints 0 and 1
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high


def discordant(reference: Sequence[bool], candidate: Sequence[bool]) -> tuple[int, int]:
    """McNemar's discordant pairs of paired right/wrong outcomes: (right only under ``reference``, right
    only under ``candidate``)."""
    pairs = list(zip(reference, candidate, strict=True))
    return sum(r and not c for r, c in pairs), sum(c and not r for r, c in pairs)


def mcnemar_exact(only_reference: int, only_candidate: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: ``only_reference`` samples right under
    the reference only, ``only_candidate`` right under the candidate only. No discordant pair: 1.0."""
    if only_reference < 0 or only_candidate < 0:
        raise ValueError("discordant counts must be >= 0")
    n = only_reference + only_candidate
    if n == 0:
        return 1.0
    k = min(only_reference, only_candidate)
    # exact integer arithmetic: sum_{i<=k} C(n, i) / 2^n (no underflow for large n)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_bootstrap(
    differences: Sequence[float], *, resamples: int = 10_000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired ``differences`` (one per sample)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size == 0:
        raise ValueError("the bootstrap needs at least one paired difference")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def paired_ratio_bootstrap(
    reference: Sequence[tuple[int, int]],
    candidate: Sequence[tuple[int, int]],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of a ratio of pooled rates, candidate over reference, from paired
    (denominator, numerator) counts per unit (MTP: draft tokens and accepted tokens per prompt): the
    same units are resampled on both sides. Resamples where the reference's rate is 0 are left out;
    None when more than half are (the ratio is undefined then)."""
    r = np.asarray(reference, dtype=np.float64).reshape(-1, 2)
    c = np.asarray(candidate, dtype=np.float64).reshape(-1, 2)
    if r.shape != c.shape or r.shape[0] == 0:
        raise ValueError(f"paired counts need the same units on both sides, got {len(r)} and {len(c)}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    idx = np.random.default_rng(seed).integers(0, r.shape[0], size=(resamples, r.shape[0]))
    rs, cs = r[idx].sum(axis=1), c[idx].sum(axis=1)  # (resamples, 2) pooled counts
    with np.errstate(divide="ignore", invalid="ignore"):
        ref_rate = rs[:, 1] / rs[:, 0]
        cand_rate = np.where(cs[:, 0] > 0, cs[:, 1] / cs[:, 0], np.nan)
        ratio = cand_rate / ref_rate
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size * 2 < resamples:
        return None
    tail = (1 - level) / 2
    low, high = np.quantile(ratio, [tail, 1 - tail])
    return float(low), float(high)


def exact_floor(alpha: float = 0.05) -> int:
    """The fewest discordant pairs, all in one direction, that the exact McNemar test can call significant
    at ``alpha`` (two-sided): the smallest k with 2 / 2^k < alpha (6 at 0.05)."""
    k = 1
    while 2 / 2**k >= alpha:
        k += 1
    return k


def min_detectable_drop(n: int, reference_accuracy: float) -> float:
    """The smallest accuracy drop detectable from ``n`` paired samples at alpha 0.05 (two-sided), power 0.8.

    The larger of (a) the exact test's floor: at least ``exact_floor(0.05)`` = 6 samples must flip, all one
    way, whatever the noise; and (b) the normal approximation (z_{alpha/2} + z_{0.8}) sqrt(2 p (1 - p) / n)
    of an unpaired comparison at the reference's accuracy p, which bounds the paired test from above when
    the two runs' errors are positively correlated (they share samples and weights). Capped at 1.0,
    which means that no drop at all was detectable (fewer than 6 samples)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    p = min(max(reference_accuracy, 0.0), 1.0)
    normal = (Z95 + Z80) * math.sqrt(2 * p * (1 - p) / n)
    return min(1.0, max(exact_floor(0.05) / n, normal))
