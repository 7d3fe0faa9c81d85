"""The README's long-context evidence table, rendered from a `mlaq validate --out DIR` run's report.json.

    python bench/evidence_table.py build/evidence/report.json

One row per task and length: the bf16 reference's accuracy with its Wilson 95 % interval and sample
count, then per scheme the paired differences against bf16 on the same samples: accuracy in points
(exact McNemar p) and the answer's mean log-probability in nats with its paired bootstrap 95 % interval.
Then each scheme's verdict and the attention top-key flip rate (mean over layers) by competing keys.
With ``--by-length`` (docs/long-context.md's layout): one table per task, a row per scheme and a column per
length, bf16's row its accuracy and every scheme's its paired differences; bf16's needle accuracy by depth
per length; and the trend table (the paired drop's slope per doubling of the length, and the longest
length's mean drop minus the shortest's, each with its bootstrap 95 % interval).
Reads only report.json's documented fields (the `--json` schema); prints markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _accuracy_cell(e: dict, sep: str) -> str:
    """bf16's accuracy [Wilson 95 %] and n of one cell (``sep`` between the interval and n)."""
    return f"{_pct(e['accuracy'])} [{_pct(e['ci_low'])}, {_pct(e['ci_high'])}]{sep}n={e['n']}"


def _delta_cell(e: dict) -> str:
    lo, hi = e["logprob_delta_ci"]
    acc = f"{100 * e['accuracy_delta']:+.0f} pts (p {e['p_value_vs_bf16']:.2g})"
    return f"{acc}; {e['logprob_delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]"


def task_rows(report: dict) -> list[str]:
    schemes = list(report["schemes"])
    ref = report["reference"]["tasks"]
    head = "| task | length | bf16: accuracy [95 % CI], n | " + " | ".join(schemes) + " |"
    rows = [head, "|---" * (3 + len(schemes)) + "|"]
    for task, per in ref.items():
        for length, e in per.items():
            cell = _accuracy_cell(e, ", ")
            deltas = [_delta_cell(report["schemes"][s]["tasks"][task][length]) for s in schemes]
            rows.append(f"| {task} | {length} | {cell} | " + " | ".join(deltas) + " |")
    return rows


def verdict_rows(report: dict) -> list[str]:
    """Verdicts, and the flip rate (mean over layers) at the fewest, middle and most competing keys."""
    some = next(iter(report["schemes"].values()))["flip_rate"]
    keys = sorted({int(k) for per in some.values() for k in per})
    keys = sorted({keys[0], keys[len(keys) // 2], keys[-1]}) if keys else []
    rows = [
        "| scheme | verdict | smallest detectable drop | "
        + " | ".join(f"flip rate, {n} keys" for n in keys)
        + " |",
        "|---" * (3 + len(keys)) + "|",
    ]
    for name, s in report["schemes"].items():
        v = s["verdict"]
        flips = []
        for n in keys:
            vals = [per[str(n)] for per in s["flip_rate"].values() if str(n) in per]
            flips.append(f"{100 * sum(vals) / len(vals):.2f} %" if vals else "—")
        rows.append(
            f"| {name} | **{v['verdict']}** | {_pct(v['min_detectable_drop'])} | " + " | ".join(flips) + " |"
        )
    return rows


def by_length_rows(report: dict) -> list[str]:
    """Per task: a row per scheme, a column per length (bf16's accuracy; the schemes' paired deltas)."""
    ref = report["reference"]["tasks"]
    out: list[str] = []
    for task, per in ref.items():
        lengths = list(per)
        out += [
            f"**{task}**",
            "",
            "| scheme | " + " | ".join(lengths) + " |",
            "|---" * (1 + len(lengths)) + "|",
        ]
        cells = [_accuracy_cell(e, " ") for e in per.values()]
        out.append("| bf16 | " + " | ".join(cells) + " |")
        for name, s in report["schemes"].items():
            out.append(f"| {name} | " + " | ".join(_delta_cell(s["tasks"][task][n]) for n in lengths) + " |")
        out.append("")
    return out


def depth_rows(report: dict) -> list[str]:
    """bf16's needle accuracy (samples) by depth, a row per length; empty without needle samples."""
    per = report["reference"].get("needle_by_depth") or {}
    if not per:
        return []
    depths = sorted({d for cells in per.values() for d in cells}, key=float)
    out = ["| length | " + " | ".join(f"depth {d}" for d in depths) + " |", "|---" * (1 + len(depths)) + "|"]
    for length, cells in per.items():
        row = [f"{_pct(cells[d]['accuracy'])} ({cells[d]['n']})" if d in cells else "—" for d in depths]
        out.append(f"| {length} | " + " | ".join(row) + " |")
    return [*out, ""]


def _trend_cell(value: float, ci: list[float], unit: str) -> str:
    scale, fmt = (100.0, "{:+.1f}") if unit == "pts" else (1.0, "{:+.4f}")
    v, lo, hi = (fmt.format(scale * x) for x in (value, *ci))
    return f"{v} [{lo}, {hi}]"


def trend_rows(report: dict) -> list[str]:
    """Per scheme and task: the accuracy and answer log-prob drops' slope per doubling and 16K - 1K."""
    out = [
        "| scheme | task | accuracy drop / doubling (pts) | longest − shortest (pts) "
        "| answer log-prob drop / doubling (nats) | longest − shortest (nats) |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in report["schemes"].items():
        for task, figs in (s.get("length_trend") or {}).items():
            cells = []
            for fig in ("accuracy", "logprob"):
                e = figs[fig]
                cells += [
                    _trend_cell(e["slope_per_doubling"], e["slope_ci"], e["unit"]),
                    _trend_cell(e["longest_minus_shortest"], e["longest_minus_shortest_ci"], e["unit"]),
                ]
            out.append(f"| {name} | {task} | " + " | ".join(cells) + " |")
    return out if len(out) > 2 else []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="report.json of a `mlaq validate --out DIR` run")
    p.add_argument("--by-length", action="store_true", help="docs/long-context.md's tables (see above)")
    a = p.parse_args(argv)
    report = json.loads(a.report.read_text())
    if a.by_length:
        print("\n".join([*by_length_rows(report), *depth_rows(report), *trend_rows(report)]))
    else:
        print("\n".join([*task_rows(report), "", *verdict_rows(report)]))


if __name__ == "__main__":
    main()
