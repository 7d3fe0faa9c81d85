"""The statistics of llama.cpp's ``perplexity --kl-divergence``, as pure functions over per-token values.

Users compare quantizations with that tool's summary, so local and remote ``mlaq validate`` print the
same list, computed the same way (tools/perplexity/perplexity.cpp in llama.cpp):
- KLD: mean ± its uncertainty, maximum, 99.9/99/95/90 % quantiles, median, 10/5/1/0.1 % quantiles, minimum;
- Δp = p_candidate(actual next token) - p_reference(actual next token): mean ± uncertainty, the same
  quantiles (with 75/25 %), RMS ± uncertainty;
- "same top p": the share of positions whose argmax agrees, ± its standard error;
- mean ln(PPL(Q)/PPL(base)) = mean ΔNLL ± uncertainty (paired per token).

Definitions as llama.cpp's: the uncertainty of a mean is sqrt((E[x^2] - E[x]^2) / (n - 1)) (0 for
n <= 10); a quantile at fraction f interpolates linearly between the sorted values at index f * (n - 1);
the RMS uncertainty is 0.5 / RMS x the uncertainty of the mean square; the same-top standard error is
sqrt(p (1 - p) / (n - 1)). llama.cpp scores only the second half of each chunk; mlaq reports every
position, split by context-length bucket, so a reader sees whether divergence grows with context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np

KLD_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DELTA_P_QUANTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


def mean_and_uncertainty(values: np.ndarray) -> tuple[float, float]:
    """Mean and the standard error of the mean, as llama.cpp computes them (0 for 10 values or fewer)."""
    n = values.size
    if n == 0:
        return 0.0, 0.0
    x = values.astype(np.float64)
    mean = float(x.mean())
    var = float((x * x).mean()) - mean * mean
    return mean, math.sqrt(var / (n - 1)) if var > 0 and n > 10 else 0.0


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's quantile: linear interpolation at index fraction * (n - 1) of sorted values."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (sorted_values.size - 1)
    i = int(p)
    w = p - i
    j = min(i + 1, sorted_values.size - 1)
    return float((1 - w) * sorted_values[i] + w * sorted_values[j])


def _label(fraction: float) -> str:
    return f"{100 * fraction:g}"


def distribution(values: np.ndarray, fractions: Sequence[float]) -> dict[str, Any]:
    s = np.sort(values.astype(np.float64))
    mean, unc = mean_and_uncertainty(s)
    return {
        "mean": mean,
        "uncertainty": unc,
        "max": float(s[-1]),
        "median": percentile(s, 0.5),
        "min": float(s[0]),
        "quantiles": {_label(f): percentile(s, f) for f in fractions},
    }


def kld_statistics(
    kl: np.ndarray, delta_p: np.ndarray, same_top: np.ndarray, nll_delta: np.ndarray
) -> dict[str, Any] | None:
    """The whole llama.cpp list over one set of positions (None when there is none).

    kl: KL(reference || candidate) per position, nats; delta_p: p_cand - p_ref of the actual next
    token; same_top: 1.0 where the argmaxes agree; nll_delta: NLL_cand - NLL_ref of the next token.
    """
    n = int(kl.size)
    if n == 0:
        return None
    dp = distribution(delta_p, DELTA_P_QUANTILES)
    mse, mse_unc = mean_and_uncertainty(delta_p.astype(np.float64) ** 2)
    rms = math.sqrt(mse)
    dp["rms"] = rms
    dp["rms_uncertainty"] = 0.5 / rms * mse_unc if rms > 0 else 0.0
    same = float(same_top.astype(np.float64).mean())
    nll_mean, nll_unc = mean_and_uncertainty(nll_delta)
    return {
        "n": n,
        "kld": distribution(kl, KLD_QUANTILES),
        "delta_p": dp,
        "same_top_p": {
            "value": same,
            "standard_error": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
        },
        "nll_delta": {"mean": nll_mean, "uncertainty": nll_unc},
    }


def kld_statistics_by_bucket(
    positions: np.ndarray,
    edges: Sequence[int],
    kl: np.ndarray,
    delta_p: np.ndarray,
    same_top: np.ndarray,
    nll_delta: np.ndarray,
) -> dict[str, Any]:
    """``{"all": stats, "buckets": [{"range": [lo, hi], **stats}, ...]}`` with buckets [edges[i],
    edges[i+1]) of context position (empty buckets carry ``n: 0``)."""
    out: dict[str, Any] = {"all": kld_statistics(kl, delta_p, same_top, nll_delta), "buckets": []}
    for lo, hi in pairwise(edges):
        m = (positions >= lo) & (positions < hi)
        stats = kld_statistics(kl[m], delta_p[m], same_top[m], nll_delta[m])
        out["buckets"].append({"range": [int(lo), int(hi)], **(stats or {"n": 0})})
    return out


MIN_N_UNCERTAINTY = 10  # fewer positions: no standard error is printed (it would be noise: "± n/a")


def pm(uncertainty: float, n: int, fmt: str) -> str:
    """``± 1.2e-03``, or ``± n/a`` below ``MIN_N_UNCERTAINTY`` positions."""
    return "± n/a" if n < MIN_N_UNCERTAINTY else f"± {uncertainty:{fmt}}"


def format_kld_statistics(stats: dict[str, Any]) -> list[str]:
    """The llama.cpp summary lines (its labels and units: KLD in nats, Δp and same top p in %)."""
    k, dp, st = stats["kld"], stats["delta_p"], stats["same_top_p"]
    n = stats["n"]
    lines = [
        f"Mean    KLD: {k['mean']:10.6f} {pm(k['uncertainty'], n, '10.6f')}",
        f"Maximum KLD: {k['max']:10.6f}",
    ]
    for f in KLD_QUANTILES[:4]:
        lines.append(f"{100 * f:4.1f}%   KLD: {k['quantiles'][_label(f)]:10.6f}")
    lines.append(f"Median  KLD: {k['median']:10.6f}")
    for f in KLD_QUANTILES[4:]:
        lines.append(f"{100 * f:4.1f}%   KLD: {k['quantiles'][_label(f)]:10.6f}")
    lines.append(f"Minimum KLD: {k['min']:10.6f}")
    lines.append(f"Mean    Δp: {100 * dp['mean']:6.3f} {pm(100 * dp['uncertainty'], n, '5.3f')} %")
    lines.append(f"Maximum Δp: {100 * dp['max']:6.3f}%")
    for f in DELTA_P_QUANTILES:
        if f == 0.25:
            lines.append(f"Median  Δp: {100 * dp['median']:6.3f}%")
        lines.append(f"{100 * f:4.1f}%   Δp: {100 * dp['quantiles'][_label(f)]:6.3f}%")
    lines.append(f"Minimum Δp: {100 * dp['min']:6.3f}%")
    lines.append(f"RMS Δp    : {100 * dp['rms']:6.3f} {pm(100 * dp['rms_uncertainty'], n, '5.3f')} %")
    lines.append(f"Same top p: {100 * st['value']:6.3f} {pm(100 * st['standard_error'], n, '5.3f')} %")
    return lines
