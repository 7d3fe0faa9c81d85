"""Statistics of the task suite and the attention flips, as pure functions of the record.

Per variant, task and length: accuracy (greedy exact match) with its Wilson 95 % interval and the
sample count; for a candidate also the paired comparison with the reference on the SAME samples: the
exact McNemar p-value, the accuracy difference, the mean answer log-probability difference and the
token accuracy difference (the share of answer tokens that are their position's argmax: partial credit
for long answers such as copy's segment) with their paired bootstrap 95 % intervals, and the smallest
accuracy drop the run could have detected.
Flip figures: per layer and bucket of competing keys, pooled over the windows.
"""

from __future__ import annotations

import math
from collections import defaultdict
from statistics import fmean
from typing import Any

from mlaq.validate.intervals import discordant, mcnemar_exact, min_detectable_drop, paired_bootstrap, wilson
from mlaq.validate.record import Record, TaskScoreRecord, TaskSuiteRecord, Totals, VariantRecord
from mlaq.validate.trend import length_trend


def _cells(suite: TaskSuiteRecord) -> dict[tuple[str, int], list[int]]:
    """(task, length) -> indices of its samples, in suite order."""
    cells: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, s in enumerate(suite.samples):
        cells[(s.task, s.length)].append(i)
    return cells


def accuracy_cell(scores: list[TaskScoreRecord]) -> dict[str, Any]:
    n = len(scores)
    correct = sum(s.correct for s in scores)
    low, high = wilson(correct, n)
    return {
        "accuracy": correct / n,
        "ci_low": low,
        "ci_high": high,
        "n": n,
        "correct": correct,
        "logprob": fmean(s.logprob for s in scores),
        "token_accuracy": fmean(s.token_accuracy for s in scores),
    }


def paired_cell(ref: list[TaskScoreRecord], cand: list[TaskScoreRecord], seed: int) -> dict[str, Any]:
    """The candidate's cell plus its paired comparison with the reference on the same samples."""
    out = accuracy_cell(cand)
    only_ref, only_cand = discordant([r.correct for r in ref], [c.correct for c in cand])
    deltas = [c.logprob - r.logprob for r, c in zip(ref, cand, strict=True)]
    token_deltas = [c.token_accuracy - r.token_accuracy for r, c in zip(ref, cand, strict=True)]
    ref_acc = sum(r.correct for r in ref) / len(ref)
    out.update(
        {
            "accuracy_delta": out["accuracy"] - ref_acc,
            "only_reference": only_ref,
            "only_candidate": only_cand,
            "p_value_vs_bf16": mcnemar_exact(only_ref, only_cand),
            "logprob_delta": fmean(deltas),
            "logprob_delta_ci": list(paired_bootstrap(deltas, seed=seed)),
            "token_accuracy_delta": fmean(token_deltas),
            "token_accuracy_delta_ci": list(paired_bootstrap(token_deltas, seed=seed)),
            "min_detectable_drop": min_detectable_drop(len(ref), ref_acc),
        }
    )
    return out


def task_table(
    suite: TaskSuiteRecord, v: VariantRecord, reference: VariantRecord | None, seed: int
) -> dict[str, dict[str, Any]]:
    """``{task: {length: cell}}`` (lengths as text, JSON keys); paired cells when ``reference`` is given."""
    out: dict[str, dict[str, Any]] = {}
    for (task, length), idx in sorted(
        _cells(suite).items(), key=lambda kv: (suite_order(suite, kv[0][0]), kv[0][1])
    ):
        mine = [v.tasks[i] for i in idx]
        cell = (
            accuracy_cell(mine)
            if reference is None
            else paired_cell([reference.tasks[i] for i in idx], mine, seed)
        )
        out.setdefault(task, {})[str(length)] = cell
    return out


def trend_table(
    suite: TaskSuiteRecord, v: VariantRecord, reference: VariantRecord, seed: int
) -> dict[str, dict[str, Any]]:
    """``{task: {"accuracy": trend, "logprob": trend}}`` for tasks measured at >= 2 lengths: does the paired
    drop against the reference (accuracy; answer log-probability) grow with length (mlaq.validate.trend)."""
    drops: dict[str, dict[str, dict[int, list[float]]]] = defaultdict(lambda: {"accuracy": {}, "logprob": {}})
    for (task, length), idx in _cells(suite).items():
        pairs = [(reference.tasks[i], v.tasks[i]) for i in idx]
        drops[task]["accuracy"][length] = [float(r.correct) - float(c.correct) for r, c in pairs]
        drops[task]["logprob"][length] = [r.logprob - c.logprob for r, c in pairs]
    return {
        task: {
            m: length_trend(d[m], unit="pts" if m == "accuracy" else "nats", seed=seed).as_dict() for m in d
        }
        for task, d in sorted(drops.items(), key=lambda kv: suite_order(suite, kv[0]))
        if len(d["accuracy"]) >= 2
    }


def task_outcomes(v: VariantRecord) -> dict[str, list[Any]]:
    """Each sample's scores, aligned with the report's ``tasks.items`` (columns: greedy exact match,
    mean answer log-probability in nats, token accuracy): what pairs two reports (``mlaq compare``)."""
    return {
        "correct": [s.correct for s in v.tasks],
        "logprob": [s.logprob for s in v.tasks],
        "token_accuracy": [s.token_accuracy for s in v.tasks],
    }


def suite_order(suite: TaskSuiteRecord, task: str) -> int:
    names = suite.config.get("tasks", [])
    return names.index(task) if task in names else len(names)


def needle_by_depth(suite: TaskSuiteRecord, v: VariantRecord) -> dict[str, dict[str, Any]]:
    """Needle accuracy by ``{length: {depth: {accuracy, n}}}`` (the heat map's cells)."""
    groups: dict[tuple[int, float], list[bool]] = defaultdict(list)
    for s, score in zip(suite.samples, v.tasks, strict=True):
        if s.task == "needle":
            groups[(s.length, s.depth)].append(score.correct)
    out: dict[str, dict[str, Any]] = {}
    for (length, depth), hits in sorted(groups.items()):
        out.setdefault(str(length), {})[f"{depth:g}"] = {"accuracy": sum(hits) / len(hits), "n": len(hits)}
    return out


def _rates(t: Totals, bucket_ends: list[int]) -> dict[str, float | None]:
    sums = [math.fsum(col) for col in zip(*t.sums, strict=True)]
    counts = [math.fsum(col) for col in zip(*t.counts, strict=True)]
    return {str(end): (s / c if c else None) for end, s, c in zip(bucket_ends, sums, counts, strict=True)}


def flip_table(v: VariantRecord, buckets: list[list[int]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{figure: {layer: {keys: value}}}`` for the flip rate, the retrieval-row flip rate and the total
    variation distance; ``keys`` is a bucket's largest number of competing keys (its end position)."""
    ends = [end for _, end in buckets]
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for figure, prefix in (
        ("flip_rate", "flip/"),
        ("flip_rate_retrieval", "flip_retrieval/"),
        ("attention_tv", "tv/"),
    ):
        layers = sorted(int(k[len(prefix) :]) for k in v.positions if k.startswith(prefix))
        if layers:
            out[figure] = {str(layer): _rates(v.positions[f"{prefix}{layer}"], ends) for layer in layers}
    if "flip_rate_retrieval" in out:  # how many (query, head) rows were retrieval-like, per layer
        prefix = "flip_retrieval/"
        out["retrieval_rows"] = {
            k[len(prefix) :]: {
                str(e): c
                for e, c in zip(ends, (math.fsum(col) for col in zip(*t.counts, strict=True)), strict=True)
            }
            for k, t in v.positions.items()
            if k.startswith(prefix)
        }
    return out


def variant_task_figures(v: VariantRecord, reference: VariantRecord | None, r: Record) -> dict[str, Any]:
    """One variant's figures from this module: task tables, needle by depth, length trend, flip rates
    (``reference`` None for the reference itself)."""
    out: dict[str, Any] = {}
    if r.tasks is not None and v.tasks:
        out["tasks"] = task_table(r.tasks, v, reference, r.seed)
        out["task_outcomes"] = task_outcomes(v)
        out["needle_by_depth"] = needle_by_depth(r.tasks, v)
        if reference is not None and (trends := trend_table(r.tasks, v, reference, r.seed)):
            out["length_trend"] = trends
    return out | flip_table(v, r.buckets)
