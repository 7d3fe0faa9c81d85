"""The README's long-context evidence table, rendered from a `mlaq validate --out DIR` run's report.json.

    python bench/evidence_table.py build/evidence/report.json

One row per task and length: the bf16 reference's accuracy with its Wilson 95 % interval and sample
count, then per scheme the paired differences against bf16 on the same samples: accuracy in points
(exact McNemar p) and the answer's mean log-probability in nats with its paired bootstrap 95 % interval.
Then each scheme's verdict and the attention top-key flip rate (mean over layers) by competing keys.
Reads only report.json's documented fields (the `--json` schema); prints markdown.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


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
            cell = f"{_pct(e['accuracy'])} [{_pct(e['ci_low'])}, {_pct(e['ci_high'])}], n={e['n']}"
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="report.json of a `mlaq validate --out DIR` run")
    a = p.parse_args(argv)
    report = json.loads(a.report.read_text())
    print("\n".join([*task_rows(report), "", *verdict_rows(report)]))


if __name__ == "__main__":
    main()
