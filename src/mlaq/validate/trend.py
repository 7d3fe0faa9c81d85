"""Does a scheme's paired damage grow with context length? A test of the trend, not only of each cell.

Input: for one scheme and one task, the paired drops of every sample at every length (a drop is the
reference's figure minus the scheme's on the SAME sample: 1 - 0 for an answer only bf16 got right, or
the fall in the answer's log-probability). Two estimates, each with a stratified bootstrap interval
(samples are resampled within each length, as they were drawn):

- ``slope``: the ordinary least-squares slope of the drop on log2(length) over all samples, i.e. how
  much the mean drop grows per doubling of the context (a paired regression on log length);
- ``difference``: the mean drop at the longest length minus the mean drop at the shortest.

The answer says "grows" only when the whole slope interval lies above 0, "shrinks" when it lies below,
and otherwise that the run saw no trend (with how large a growth the interval still allows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Trend:
    """The trend of one scheme's paired drop over lengths (``unit``: "pts" for accuracy, "nats")."""

    lengths: tuple[int, ...]
    n: tuple[int, ...]  # samples per length
    mean_drop: tuple[float, ...]  # per length
    slope: float  # per doubling of the length
    slope_ci: tuple[float, float]
    difference: float  # longest minus shortest length's mean drop
    difference_ci: tuple[float, float]
    unit: str

    @property
    def answer(self) -> str:
        return trend_answer(self)

    def as_dict(self) -> dict:
        return {
            "lengths": list(self.lengths),
            "n": list(self.n),
            "mean_drop": list(self.mean_drop),
            "slope_per_doubling": self.slope,
            "slope_ci": list(self.slope_ci),
            "longest_minus_shortest": self.difference,
            "longest_minus_shortest_ci": list(self.difference_ci),
            "unit": self.unit,
            "answer": self.answer,
        }


def ols_slope(x: np.ndarray, y: np.ndarray) -> float:
    """Least-squares slope of y on x (x not all equal)."""
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def length_trend(
    drops: Mapping[int, Sequence[float]],
    *,
    unit: str = "pts",
    resamples: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> Trend:
    """The trend of paired ``drops`` ({length: per-sample drops}) over >= 2 lengths, with intervals."""
    cells = {int(k): np.asarray(v, dtype=np.float64) for k, v in drops.items()}
    if len(cells) < 2:
        raise ValueError(f"a trend over length needs at least 2 lengths, got {sorted(cells)}")
    if any(v.size == 0 for v in cells.values()):
        raise ValueError("every length needs at least one paired sample")
    lengths = tuple(sorted(cells))
    ys = [cells[n] for n in lengths]
    x = np.concatenate([np.full(y.size, np.log2(n)) for n, y in zip(lengths, ys, strict=True)])
    rng = np.random.default_rng(seed)
    picks = [rng.integers(0, y.size, size=(resamples, y.size)) for y in ys]  # stratified: within a length
    boot = [y[p] for y, p in zip(ys, picks, strict=True)]  # (resamples, n_length) each
    all_y = np.concatenate(boot, axis=1)  # (resamples, N)
    xc = x - x.mean()
    slopes = (all_y - all_y.mean(1, keepdims=True)) @ xc / (xc * xc).sum()
    diffs = boot[-1].mean(1) - boot[0].mean(1)
    tail = 100 * (1 - level) / 2
    ci = lambda a: (float(np.percentile(a, tail)), float(np.percentile(a, 100 - tail)))  # noqa: E731
    return Trend(
        lengths=lengths,
        n=tuple(y.size for y in ys),
        mean_drop=tuple(float(y.mean()) for y in ys),
        slope=ols_slope(x, np.concatenate(ys)),
        slope_ci=ci(slopes),
        difference=float(ys[-1].mean() - ys[0].mean()),
        difference_ci=ci(diffs),
        unit=unit,
    )


def _amount(value: float, unit: str) -> str:
    return f"{100 * value:+.1f} pts" if unit == "pts" else f"{value:+.3f} nats"


def trend_answer(t: Trend) -> str:
    """One sentence: does the drop grow with length, by how much per doubling, with its interval."""
    lo, hi = t.slope_ci
    per = (
        f"{_amount(t.slope, t.unit)} per doubling of the length (95 % CI {_amount(lo, t.unit)} to "
        f"{_amount(hi, t.unit)}; {t.lengths[-1]} minus {t.lengths[0]} tokens: {_amount(t.difference, t.unit)}, "
        f"CI {_amount(t.difference_ci[0], t.unit)} to {_amount(t.difference_ci[1], t.unit)})"
    )
    if lo == hi == 0:  # every resample flat (e.g. no sample changed its answer): no bound on the trend
        return (f"No trend with length was seen, and none can be bounded: {per}; every bootstrap resample is flat "
                f"(n = {'/'.join(str(n) for n in t.n)} per length), so take more samples.")  # fmt: skip
    if lo > 0:
        return f"The drop grows with length: {per}."
    if hi < 0:
        return f"The drop shrinks with length: {per}."
    return f"No trend with length was seen: {per}; a growth above {_amount(hi, t.unit)} per doubling is ruled out."
