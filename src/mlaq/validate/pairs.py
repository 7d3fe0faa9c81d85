"""Two validate reports on the same task samples, compared sample by sample (``mlaq compare``).

A report.json holds its task samples (``tasks.items``: task, length, index, depth and a fingerprint of
the token ids) and every variant's outcome on each of them (``task_outcomes``). Two runs with the same
--tasks, --lengths, --task-samples, --needle-depths, --seed, eval text and tokenizer draw the same
samples, whatever the checkpoint: then two checkpoints (before and after a fine-tune, two quantized
exports) or two variants of one run can be compared on the SAME samples, the comparison the per-run
Wilson intervals cannot make. Per (task, length) cell and per needle depth: each side's accuracy with its
Wilson 95 % interval, the discordant samples (right only on A, right only on B), the exact McNemar
p-value, and the paired differences B - A of accuracy and of the mean answer log-probability with their
paired bootstrap 95 % intervals (resampling samples).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from mlaq.validate.intervals import discordant, mcnemar_exact, paired_bootstrap, wilson
from mlaq.validate.report import REPORT_JSON


@dataclass(frozen=True)
class Side:
    """One side of a comparison: a report's samples and one variant's outcomes on them."""

    path: str
    model: str
    variant: str
    items: tuple[Mapping[str, Any], ...]  # task, length, index, depth, fingerprint
    correct: tuple[bool, ...]
    logprob: tuple[float, ...]


def load_side(path: str | Path, variant: str | None = None) -> Side:
    """The side of ``path`` (a report.json or the --out directory holding one) for ``variant`` (default:
    the report's reference); ValueError saying what is wrong and how to get a report that pairs."""
    p = Path(path)
    if p.is_dir():
        p = p / REPORT_JSON
    if not p.is_file():
        raise ValueError(
            f"{path}: no such report (give a report.json or the --out directory of mlaq validate)"
        )
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not a JSON report ({exc})") from None
    if not isinstance(obj, dict) or "reference" not in obj or "schemes" not in obj:
        raise ValueError(f"{p}: not an mlaq validate report (no reference or schemes)")
    suite = obj.get("tasks")
    if not suite:
        raise ValueError(f"{p}: the run measured no long-context task (it ran with --tasks none)")
    variants = {obj["reference"]["name"]: obj["reference"], **obj["schemes"]}
    if obj.get("noise_floor"):
        variants[obj["noise_floor"]["name"]] = obj["noise_floor"]
    if obj.get("as_configured"):
        variants["as-configured"] = obj["as_configured"]
    name = variant or obj["reference"]["name"]
    if name not in variants:
        raise ValueError(f"{p}: no variant {name!r}; this report has {', '.join(variants)}")
    outcomes = variants[name].get("task_outcomes")
    if "items" not in suite or outcomes is None:
        raise ValueError(
            f"{p}: the report has no per-sample task outcomes (written by an older mlaq): run mlaq validate again"
        )
    items = tuple(suite["items"])
    if not len(items) == len(outcomes["correct"]) == len(outcomes["logprob"]):
        raise ValueError(f"{p}: {name}'s task outcomes do not match the report's {len(items)} samples")
    model = str((obj.get("model") or {}).get("path", "?"))
    return Side(str(p), model, name, items, tuple(outcomes["correct"]), tuple(outcomes["logprob"]))


def check_same_samples(a: Side, b: Side) -> None:
    """ValueError unless ``a`` and ``b`` hold the same samples in the same order (equal fingerprints)."""
    if len(a.items) != len(b.items):
        raise ValueError(f"{a.path} has {len(a.items)} task samples, {b.path} {len(b.items)}: {_SAME}")
    for x, y in zip(a.items, b.items, strict=True):
        if x["fingerprint"] != y["fingerprint"] or not x["fingerprint"]:
            where = f"{x['task']} at {x['length']} tokens, sample {x['index']}"
            raise ValueError(f"the two reports hold different samples (first: {where}): {_SAME}")


_SAME = (
    "run both with the same --tasks, --lengths, --task-samples, --needle-depths, --seed and --eval-text "
    "(and the same tokenizer)"
)


def _cell(a: Side, b: Side, idx: Sequence[int], seed: int) -> dict[str, Any]:
    ca, cb = [a.correct[i] for i in idx], [b.correct[i] for i in idx]
    n = len(idx)
    only_a, only_b = discordant(ca, cb)
    acc_deltas = [float(y) - float(x) for x, y in zip(ca, cb, strict=True)]
    lp_deltas = [b.logprob[i] - a.logprob[i] for i in idx]
    out: dict[str, Any] = {"n": n}
    for side, hits in (("a", ca), ("b", cb)):
        low, high = wilson(sum(hits), n)
        out[side] = {"correct": sum(hits), "accuracy": sum(hits) / n, "ci": [low, high]}
    return out | {
        "only_a": only_a,
        "only_b": only_b,
        "p_value": mcnemar_exact(only_a, only_b),
        "accuracy_delta": fmean(acc_deltas),
        "accuracy_delta_ci": list(paired_bootstrap(acc_deltas, seed=seed)),
        "logprob_delta": fmean(lp_deltas),
        "logprob_delta_ci": list(paired_bootstrap(lp_deltas, seed=seed)),
    }


def compare(a: Side, b: Side, seed: int = 0) -> dict[str, Any]:
    """``{"a", "b", "cells": {task: {length: cell}}, "needle_by_depth": {length: {depth: cell}}}``;
    lengths and depths as text (JSON keys). The same samples or ValueError (``check_same_samples``)."""
    check_same_samples(a, b)
    cells: dict[tuple[str, int], list[int]] = defaultdict(list)
    depths: dict[tuple[int, float], list[int]] = defaultdict(list)
    for i, it in enumerate(a.items):
        cells[(it["task"], it["length"])].append(i)
        if it["task"] == "needle":
            depths[(it["length"], it["depth"])].append(i)
    order = list(dict.fromkeys(it["task"] for it in a.items))
    out: dict[str, Any] = {
        "a": {"report": a.path, "model": a.model, "variant": a.variant},
        "b": {"report": b.path, "model": b.model, "variant": b.variant},
        "cells": {},
        "needle_by_depth": {},
    }
    for (task, length), idx in sorted(cells.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        out["cells"].setdefault(task, {})[str(length)] = _cell(a, b, idx, seed)
    for (length, depth), idx in sorted(depths.items()):
        out["needle_by_depth"].setdefault(str(length), {})[f"{depth:g}"] = _cell(a, b, idx, seed)
    return out
