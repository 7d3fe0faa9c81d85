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
- a task bf16 itself cannot do (at every length it ran: bf16's accuracy below the smallest drop the
  run could detect, or below ``max_drop``) cannot show a drop: it is "not measurable on this model",
  named in the reasons, and the verdict rests on the other tasks (each at its longest measurable length);
- ``ok`` when nothing is degraded AND every measured task shows no drop with power: either the smallest
  detectable accuracy drop (alpha 0.05, power 0.8, ``intervals.min_detectable_drop``) is at most
  ``max_drop``, or the answer log-probability is equivalent to bf16's (the whole paired bootstrap 95 %
  interval of its change above -``max_logprob_drop`` nats, n >= ``min_equivalence_samples``);
- ``inconclusive`` otherwise, saying what was missing (samples needed, or no task measurable).
``reason`` is the verdict in one line (the terminal table prints it); ``min_detectable_drop`` is the
largest over the measured tasks: a smaller accuracy drop may be there unseen.
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
    min_equivalence_samples: int = 16  # the log-prob equivalence route needs this many paired samples

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
    judged = judge_tasks(tasks, cfg)
    missing = [*judged.missing] if tasks else ["no long-context task ran"]
    status = "degraded" if degraded else ("inconclusive" if missing else "ok")
    reasons = degraded if degraded else (missing if missing else judged.passed)
    if judged.not_measurable and judged.measured:
        reasons = [*reasons, "not measurable on this model: " + ", ".join(judged.not_measurable)]
    return {
        "verdict": status,
        "reasons": reasons,
        "reason": one_line(status, reasons, judged),
        "min_detectable_drop": judged.detectable,
        "measured_tasks": judged.measured,
        "not_measurable": judged.not_measurable,
        "acceptance_ratio": acceptance,
        "acceptance_ratio_ci": cand.get("acceptance_ratio_ci"),
    }


@dataclass(frozen=True)
class TaskJudgement:
    """What the task cells say: which tasks the run could measure, why the others could not, whether
    each measured task shows no drop with enough power (``passed``) or what was missing."""

    measured: list[str]  # "needle at 4096"
    not_measurable: list[str]  # "vartrack at 4096 (bf16 0 %, n=4)"
    passed: list[str]
    missing: list[str]
    detectable: float | None  # the largest smallest-detectable-drop over the measured tasks


def judge_tasks(tasks: dict[str, Any], cfg: VerdictConfig) -> TaskJudgement:
    """Per task, its longest length at which bf16 answers often enough to lose a detectable drop; a task
    with no such length is not measurable on this model and the verdict rests on the others. A measured
    task shows no drop when the run could detect ``max_drop`` in accuracy (exact McNemar, power 0.8), or
    when the answer log-probability is equivalent: the whole paired 95 % interval of its change lies
    above -``max_logprob_drop`` nats, over at least ``min_equivalence_samples`` samples (the continuous
    score has far more power than exact match on a model that answers almost always right)."""
    measured, not_measurable, passed, missing = [], [], [], []
    detectable = None
    for task, by_len in tasks.items():
        cells = sorted(((int(n), c) for n, c in by_len.items()), reverse=True)
        usable = [(n, c) for n, c in cells if _measurable(c, cfg)]
        if not usable:
            n, c = cells[0]
            not_measurable.append(f"{task} at {n} (bf16 {100 * _ref_accuracy(c):.0f} %, n={c['n']})")
            continue
        length, c = usable[0]
        where = f"{task} at {length}"
        measured.append(where)
        mde = c["min_detectable_drop"]
        detectable = mde if detectable is None else max(detectable, mde)
        low = c["logprob_delta_ci"][0]
        if mde <= cfg.max_drop:
            passed.append(f"{where}: no accuracy drop of {100 * mde:.0f} points or more (n={c['n']})")
        elif c["n"] >= cfg.min_equivalence_samples and low >= -cfg.max_logprob_drop:
            passed.append(
                f"{where}: answer log-prob within {cfg.max_logprob_drop:g} nats of bf16 "
                f"(95 % CI {low:+.3f} to {c['logprob_delta_ci'][1]:+.3f}, n={c['n']}); "
                f"accuracy drops of {100 * mde:.0f} points or more excluded"
            )
        else:
            need = samples_needed(_ref_accuracy(c), cfg.max_drop)
            missing.append(
                f"{where}: n={c['n']} detects accuracy drops of {100 * mde:.0f} points or more and the answer "
                f"log-prob interval ({low:+.3f} nats) reaches below -{cfg.max_logprob_drop:g}; "
                f"--task-samples {task}={need} detects {100 * cfg.max_drop:g}"
            )
    if tasks and not measured:
        missing.append("no task is measurable on this model: " + ", ".join(not_measurable))
    return TaskJudgement(measured, not_measurable, passed, missing, detectable)


def _ref_accuracy(c: dict[str, Any]) -> float:
    return c["accuracy"] - c["accuracy_delta"]


def _measurable(c: dict[str, Any], cfg: VerdictConfig) -> bool:
    """bf16 answers often enough to lose a drop the run could see (at least ``max_drop``, at least the
    smallest detectable drop)."""
    ref_acc = _ref_accuracy(c)
    return ref_acc >= cfg.max_drop and ref_acc >= c["min_detectable_drop"]


def one_line(status: str, reasons: list[str], judged: TaskJudgement) -> str:
    """The verdict's reason in one line (the terminal table's): the first reason, what the verdict rests
    on, and which tasks could not be measured."""
    own = [r for r in reasons if not r.startswith("not measurable on this model")]
    rest = f" (+{len(own) - 1} more)" if len(own) > 1 else ""
    if status == "ok":
        mde = (
            ""
            if judged.detectable is None
            else f" (accuracy drops >= {100 * judged.detectable:.0f} pts excluded"
        )
        line = f"no drop on {', '.join(judged.measured)}{mde}"
        if any("log-prob within" in r for r in reasons):
            line += ", answer log-prob equivalent"
        line += ")" if mde else ""
    else:
        line = (own[0] if own else "—") + rest
    if judged.not_measurable and judged.measured:
        line += "; not measurable on this model: " + ", ".join(judged.not_measurable)
    return line


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
