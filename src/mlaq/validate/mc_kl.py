"""KL(reference || candidate) by Monte Carlo from chosen-token log-probabilities, with its interval.

Top-k log-probabilities understate KL (``topk_kl``: a lower bound whose gap is the reference's mass
outside the returned tokens), and the whole distribution per position is slow to return. An unbiased
estimate needs only the log-probability of ONE token per position on each side, provided that token
was drawn from the reference: sample continuations from the reference at temperature 1, score the
same tokens on both servers (teacher-forced), and with r = q(x) / p(x) for x ~ p:

- k1 = -log r = log p(x) - log q(x): E_p[k1] = KL(p || q) (the log-ratio estimator); a single value
  can be negative, so its variance is large when p and q are close;
- k3 = (r - 1) - log r: E_p[r - 1] = sum_x q(x) - 1 = 0, so E_p[k3] = KL(p || q) too, and every k3 is
  >= 0 (log r <= r - 1): a lower-variance form (Schulman, "Approximating KL divergence", 2020).

Both are means over positions of the reference's own continuations (each position's prefix is the
prompt plus the tokens sampled before it). Positions of one continuation are correlated, so the 95 %
interval is a percentile bootstrap that resamples whole continuations. Below ``MIN_SEQUENCES``
continuations no interval is given (n/a): a bootstrap over a handful of units undercovers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

MIN_SEQUENCES = 8  # fewer continuations: the interval is n/a


@dataclass(frozen=True)
class McKL:
    """One estimator's figure over ``sequences`` continuations (``positions`` tokens in all)."""

    estimator: str  # "k1" (log-ratio) or "k3" ((r - 1) - log r)
    kl: float  # nats per token, mean over positions
    ci: tuple[float, float] | None  # bootstrap 95 % over continuations; None below MIN_SEQUENCES
    sequences: int
    positions: int

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ci": None if self.ci is None else list(self.ci)}


def per_token(ref_logprobs: np.ndarray, cand_logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(k1, k3) per position from log p(x) and log q(x) of the same sampled tokens x ~ p."""
    lp, lq = np.asarray(ref_logprobs, dtype=np.float64), np.asarray(cand_logprobs, dtype=np.float64)
    if lp.shape != lq.shape:
        raise ValueError(f"log-probabilities of different positions: {lp.shape} vs {lq.shape}")
    log_r = lq - lp  # log q(x) / p(x)
    k1 = -log_r
    k3 = np.expm1(log_r) - log_r  # (r - 1) - log r, accurate for r near 1
    return k1, k3


def estimate(
    ref: Sequence[np.ndarray],
    cand: Sequence[np.ndarray],
    *,
    resamples: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> dict[str, McKL]:
    """Both estimators over continuations: ``ref[i]`` / ``cand[i]`` are log p / log q of continuation
    i's sampled tokens (one value per token)."""
    if len(ref) != len(cand) or not ref:
        raise ValueError(f"need the same continuations on both sides, got {len(ref)} and {len(cand)}")
    sums = {"k1": [], "k3": []}
    counts = []
    for p, q in zip(ref, cand, strict=True):
        k1, k3 = per_token(p, q)
        if not np.all(np.isfinite(k1)):
            raise ValueError(
                "a sampled token has log-probability -inf on one side (the candidate gives it no mass): "
                "KL(reference || candidate) is infinite"
            )
        sums["k1"].append(math.fsum(k1))
        sums["k3"].append(math.fsum(k3))
        counts.append(len(k1))
    n = np.asarray(counts, dtype=np.float64)
    if n.sum() == 0:
        raise ValueError("the continuations hold no token")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(n), size=(resamples, len(n)))  # the same resamples for both estimators
    out = {}
    for name, s in sums.items():
        total = np.asarray(s)
        ci = None
        if len(n) >= MIN_SEQUENCES:
            means = total[idx].sum(axis=1) / np.maximum(n[idx].sum(axis=1), 1.0)  # ratio of pooled sums
            tail = (1 - level) / 2
            low, high = np.quantile(means, [tail, 1 - tail])
            ci = (float(low), float(high))
        out[name] = McKL(name, float(total.sum() / n.sum()), ci, len(n), int(n.sum()))
    return out


def summary(per_token: dict[str, list[list[float]]], seed: int = 0) -> dict[str, Any] | None:
    """The report's ``mc_kl``: both estimators, and the top-k KL at the same positions (exact when every
    position's distributions were whole, else a lower bound), from a server record's per-token lists."""
    ref, cand = per_token.get("mc_ref_logprob"), per_token.get("mc_cand_logprob")
    if not ref or not cand:
        return None
    est = estimate([np.asarray(x) for x in ref], [np.asarray(x) for x in cand], seed=seed)
    topk = [x for seq in per_token.get("mc_topk_kl", []) for x in seq]
    exact = [x for seq in per_token.get("mc_exact", []) for x in seq]
    share = sum(exact) / len(exact) if exact else 0.0
    return {
        "k1": est["k1"].to_json(),
        "k3": est["k3"].to_json(),
        "min_sequences": MIN_SEQUENCES,
        "topk_kl": math.fsum(topk) / len(topk) if topk else None,
        "topk_exact_share": share,
        "topk_is_exact": bool(exact) and share == 1.0,  # "exact" only when every position is
    }


def exact_kl(ref_top: Sequence[dict[int, float]], cand_top: Sequence[dict[int, float]]) -> float | None:
    """Mean full-vocabulary KL over the same positions when both sides returned whole distributions
    (probability mass within 1e-6 of 1 on both); None when any position is not whole."""
    total = 0.0
    for p, q in zip(ref_top, cand_top, strict=True):
        mass_p = math.fsum(math.exp(v) for v in p.values())
        mass_q = math.fsum(math.exp(v) for v in q.values())
        if abs(mass_p - 1) > 1e-6 or abs(mass_q - 1) > 1e-6:
            return None
        total += math.fsum(math.exp(lp) * (lp - q.get(t, -math.inf)) for t, lp in p.items() if lp > -math.inf)
    return total / len(ref_top) if ref_top else None
