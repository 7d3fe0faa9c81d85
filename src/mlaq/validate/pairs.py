"""Two validate reports on the same task samples, compared sample by sample (``mlaq compare``).

A report.json holds its task samples (``tasks.items``: task, length, index, depth and a fingerprint of
the token ids) and every variant's outcome on each of them (``task_outcomes``). Two runs with the same
--needle-depths, --seed, eval text and tokenizer draw the same sample for the same (task, length,
index), whatever the checkpoint: then two checkpoints (before and after a fine-tune, two quantized
exports) or two variants of one run can be compared on the SAME samples, the comparison the per-run
Wilson intervals cannot make. Samples only one report holds (other --lengths, --tasks or
--task-samples) are left out and named; a sample both hold under one key with different token ids is an
error. Per (task, length) cell and per needle depth: each side's accuracy with its
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


Key = tuple[str, int, int]  # task, length, index


def _key(item: Mapping[str, Any]) -> Key:
    return (item["task"], int(item["length"]), int(item["index"]))


def pair_samples(a: Side, b: Side) -> tuple[list[tuple[int, int]], list[str], list[str]]:
    """The samples both sides hold, as (index in a, index in b) in a's order, and the (task, length) cells
    only a or only b holds ("needle at 1024 tokens, 50 samples"). ValueError when a key holds different
    samples (fingerprints differ) or when the two share no sample."""
    where_b = {_key(y): j for j, y in enumerate(b.items)}
    pairs: list[tuple[int, int]] = []
    for i, x in enumerate(a.items):
        j = where_b.get(_key(x))
        if j is None:
            continue
        if x["fingerprint"] != b.items[j]["fingerprint"] or not x["fingerprint"]:
            where = f"{x['task']} at {x['length']} tokens, sample {x['index']}"
            raise ValueError(f"the two reports hold different samples (first: {where}): {_SAME}")
        pairs.append((i, j))
    if not pairs:
        raise ValueError(f"{a.path} and {b.path} share no task sample (no common task and length): {_SAME}")
    return pairs, _left_out(a.items, {i for i, _ in pairs}), _left_out(b.items, {j for _, j in pairs})


def _left_out(items: Sequence[Mapping[str, Any]], paired: set[int]) -> list[str]:
    cells: dict[tuple[str, int], int] = defaultdict(int)
    for i, it in enumerate(items):
        if i not in paired:
            cells[(it["task"], int(it["length"]))] += 1
    return [f"{task} at {length} tokens, {n} samples" for (task, length), n in cells.items()]


_SAME = (
    "run both with the same --needle-depths, --seed and --eval-text (and the same tokenizer) and at least "
    "one task and length in common"
)


def _cell(a: Side, b: Side, idx: Sequence[tuple[int, int]], seed: int) -> dict[str, Any]:
    ca, cb = [a.correct[i] for i, _ in idx], [b.correct[j] for _, j in idx]
    n = len(idx)
    only_a, only_b = discordant(ca, cb)
    acc_deltas = [float(y) - float(x) for x, y in zip(ca, cb, strict=True)]
    lp_deltas = [b.logprob[j] - a.logprob[i] for i, j in idx]
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
    """``{"a", "b", "cells": {task: {length: cell}}, "needle_by_depth": {length: {depth: cell}}}`` over the
    samples both hold (``pair_samples``; "a_only" / "b_only" name the cells left out); lengths and depths as
    text (JSON keys)."""
    pairs, a_only, b_only = pair_samples(a, b)
    cells: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    depths: dict[tuple[int, float], list[tuple[int, int]]] = defaultdict(list)
    for i, j in pairs:
        it = a.items[i]
        cells[(it["task"], it["length"])].append((i, j))
        if it["task"] == "needle":
            depths[(it["length"], it["depth"])].append((i, j))
    order = list(dict.fromkeys(it["task"] for it in a.items))
    out: dict[str, Any] = {
        "a": {"report": a.path, "model": a.model, "variant": a.variant},
        "b": {"report": b.path, "model": b.model, "variant": b.variant},
        "paired": len(pairs),
        "a_only": a_only,
        "b_only": b_only,
        "cells": {},
        "needle_by_depth": {},
    }
    for (task, length), idx in sorted(cells.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        out["cells"].setdefault(task, {})[str(length)] = _cell(a, b, idx, seed)
    for (length, depth), idx in sorted(depths.items()):
        out["needle_by_depth"].setdefault(str(length), {})[f"{depth:g}"] = _cell(a, b, idx, seed)
    return out
