"""A verdict per scheme a CI pipeline can gate on: ``ok``, ``degraded`` or ``inconclusive`` against bf16.

What deployments gate on today is a hypothesis test on a short eval plus a speculative-acceptance
floor at 0.95 x the reference (TensorRT-LLM's "collapse tripwire"). Here, from the summarized report:
- ``degraded`` when any of: a task cell (task, length) where the scheme is right less often than bf16
  on the same samples with a Holm-adjusted exact McNemar p < alpha (Holm over the scheme's cells, so
  more lengths do not mean more false alarms); a cell whose answer log-probability falls by more than
  ``max_logprob_drop`` nats with the whole paired bootstrap interval below that; mean KL above
  ``max_kl``; MTP acceptance below ``acceptance_low`` x bf16 or above ``acceptance_high`` x bf16
  (repetition loops make drafting easy), compared only with >= ``min_prompts`` prompts and, where
  per-prompt counts exist, only when the whole paired bootstrap 95 % interval of the ratio lies
  beyond the bound (acceptance varies by tens of points between prompts: a point estimate over 8
  prompts crosses 0.95 by chance; a collapse, 58.5 % -> 0 %, lies far beyond any interval);
- ``ok`` when nothing is degraded AND the run could have seen a drop of ``max_drop``: for every task,
  bf16 solves the longest length well enough to lose that much, and the smallest detectable drop
  there (alpha 0.05, power 0.8, ``intervals.min_detectable_drop``) is at most ``max_drop``;
- ``inconclusive`` otherwise, saying what was missing (samples needed, or tasks bf16 cannot do).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from mlaq.validate.intervals import Z80, Z95, exact_floor, min_detectable_drop


@dataclass(frozen=True)
class VerdictConfig:
    alpha: float = 0.05
    max_drop: float = 0.05  # accuracy drop (absolute) the run must be able to detect to say "ok"
    max_kl: float = 0.01  # nats, mean over teacher-forced positions
    max_logprob_drop: float = 0.1  # nats, mean answer log-probability
    acceptance_low: float = 0.95
    acceptance_high: float = 1.2
    min_prompts: int = 5

    def __post_init__(self) -> None:
        if not 0 < self.alpha < 1 or not 0 < self.max_drop <= 1:
            raise ValueError("alpha must be in (0, 1) and --max-drop in (0, 1]")
        if self.max_kl <= 0 or self.max_logprob_drop <= 0:
            raise ValueError("--max-kl and the log-prob drop must be positive")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def samples_needed(reference_accuracy: float, max_drop: float) -> int:
    """The fewest paired samples per cell whose detectable drop is <= ``max_drop`` (the inverse of
    ``min_detectable_drop``: n >= 6 / drop and n >= (z_a + z_b)^2 2 p (1 - p) / drop^2)."""
    p = reference_accuracy
    n = max(
        math.ceil(exact_floor(0.05) / max_drop), math.ceil((Z95 + Z80) ** 2 * 2 * p * (1 - p) / max_drop**2)
    )
    while n > 1 and min_detectable_drop(n - 1, p) <= max_drop:  # float rounding at the boundary
        n -= 1
    while min_detectable_drop(n, p) > max_drop:
        n += 1
    return n


def holm(p_values: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (same order as given)."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    out = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        out[i] = running
    return out


def verdict(
    cand: dict[str, Any], ref: dict[str, Any], prompts: int, cfg: VerdictConfig = VerdictConfig()
) -> dict[str, Any]:
    """The verdict of one candidate's summary ``cand`` against the reference's ``ref`` (report dicts)."""
    degraded: list[str] = []
    missing: list[str] = []
    tasks = cand.get("tasks") or {}
    cells = [(t, int(n), c) for t, by_len in tasks.items() for n, c in by_len.items()]
    adjusted = holm([c["p_value_vs_bf16"] for _, _, c in cells])
    for (task, length, c), p in zip(cells, adjusted, strict=True):
        c["p_value_holm"] = p
        if c["accuracy_delta"] < 0 and p < cfg.alpha:
            degraded.append(
                f"{task} at {length}: accuracy {100 * c['accuracy']:.0f} % vs bf16 "
                f"{100 * (c['accuracy'] - c['accuracy_delta']):.0f} % (n={c['n']}, Holm-adjusted p={p:.3g})"
            )
        low, high = c["logprob_delta_ci"]
        if high < -cfg.max_logprob_drop:
            degraded.append(
                f"{task} at {length}: answer log-prob {c['logprob_delta']:+.3f} nats "
                f"(95 % CI {low:+.3f} to {high:+.3f}, n={c['n']})"
            )
    kl = cand.get("kl")
    if kl is not None and kl > cfg.max_kl:
        degraded.append(f"mean KL {kl:.2e} nats > {cfg.max_kl:g}")
    acceptance = _acceptance(cand, ref, prompts, cfg, degraded)
    detectable = None
    if not tasks:
        missing.append("no long-context task ran")
    for task, by_len in tasks.items():
        longest = max(by_len, key=int)
        c = by_len[longest]
        ref_acc = c["accuracy"] - c["accuracy_delta"]
        mde = c["min_detectable_drop"]
        detectable = mde if detectable is None else max(detectable, mde)
        if ref_acc < cfg.max_drop or ref_acc < mde:
            missing.append(
                f"{task} at {longest}: bf16 answers {100 * ref_acc:.0f} % (n={c['n']}), too few to show a drop"
            )
        elif mde > cfg.max_drop:
            need = samples_needed(ref_acc, cfg.max_drop)
            missing.append(
                f"{task} at {longest}: n={c['n']} detects drops of {100 * mde:.0f} points or more"
                + f"; --task-samples {need} detects {100 * cfg.max_drop:g}"
            )
    status = "degraded" if degraded else ("inconclusive" if missing else "ok")
    return {
        "verdict": status,
        "reasons": degraded if degraded else missing,
        "min_detectable_drop": detectable,
        "acceptance_ratio": acceptance,
        "acceptance_ratio_ci": cand.get("acceptance_ratio_ci"),
    }


def _acceptance(
    cand: dict[str, Any], ref: dict[str, Any], prompts: int, cfg: VerdictConfig, degraded: list[str]
) -> float | None:
    a, r = cand.get("acceptance_rate"), ref.get("acceptance_rate")
    if a is None or r is None or r == 0:
        return None
    ratio = a / r
    if prompts < cfg.min_prompts:
        return ratio  # acceptance varies ~50 % between prompts: too few to compare
    ci = cand.get("acceptance_ratio_ci")
    low, high = (ratio, ratio) if ci is None else ci  # no per-prompt counts: the point estimate
    how = (
        f"{ratio:.2f} x bf16, point estimate"
        if ci is None
        else f"{ratio:.2f} x bf16, 95 % CI {low:.2f}-{high:.2f}"
    )
    if high < cfg.acceptance_low:
        degraded.append(
            f"MTP acceptance {100 * a:.1f} % vs bf16 {100 * r:.1f} % ({how}) < {cfg.acceptance_low:g} x bf16"
        )
    elif low > cfg.acceptance_high:
        degraded.append(
            f"MTP acceptance {100 * a:.1f} % vs bf16 {100 * r:.1f} % ({how}) > {cfg.acceptance_high:g} x bf16: "
            "repetition makes drafting easy"
        )
    return ratio
