"""``mlaq compare A B`` — two validate reports' long-context task outcomes, sample by sample.

Both runs must have drawn their samples with the same --needle-depths, --seed, eval text and tokenizer:
two checkpoints, or two variants of one run (``--variants``). They are paired on the samples both hold
(the cells only one holds, from other --lengths, --tasks or --task-samples, are named and left out). Prints,
per task and length and per needle depth, each side's accuracy with its Wilson 95 % interval, the
samples only one side answers, the exact McNemar p-value and the paired change B - A.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A", help="a report.json of mlaq validate, or its --out directory")
    parser.add_argument(
        "b", metavar="B", help="the other report (drawn with the same --seed, --needle-depths and eval text)"
    )
    parser.add_argument(
        "--variants",
        metavar="VA[,VB]",
        help="which variant of each report: one name for both, or A's and B's (default: each report's "
        "reference, bf16), e.g. --variants bf16,mxfp4 with the same report twice",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the paired bootstrap (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def _side(s: dict[str, Any], n: int) -> str:
    return f"{s['correct']}/{n} {_pct(s['accuracy'])} [{100 * s['ci'][0]:.0f}, {100 * s['ci'][1]:.0f}]"


def _row(label: list[str], c: dict[str, Any]) -> list[str]:
    lo, hi = c["logprob_delta_ci"]
    return [
        *label,
        _side(c["a"], c["n"]),
        _side(c["b"], c["n"]),
        str(c["only_a"]),
        str(c["only_b"]),
        f"{c['p_value']:.3g}",
        f"{c['logprob_delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]",
    ]


def _table(head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in [head, *rows])


def format_text(out: dict[str, Any]) -> str:
    tail = ["A right only", "B right only", "McNemar p", "logprob B - A (95 % CI)"]
    a, b = out["a"], out["b"]
    lines = [
        f"A: {a['report']} ({a['model']}, {a['variant']})",
        f"B: {b['report']} ({b['model']}, {b['variant']})",
        "",
    ]
    rows = [_row([task, length], c) for task, cells in out["cells"].items() for length, c in cells.items()]
    lines.append(_table(["task", "length", "A", "B", *tail], rows))
    for side, cells in (("A", out["a_only"]), ("B", out["b_only"])):
        if cells:
            lines += ["", f"Only in {side}, left out: " + "; ".join(cells)]
    for length, by_depth in out["needle_by_depth"].items():
        rows = [_row([depth], c) for depth, c in by_depth.items()]
        lines += ["", f"needle by depth at {length} tokens (0: the start of the context)"]
        lines.append(_table(["depth", "A", "B", *tail], rows))
    lines += [
        "",
        "Same samples on both sides: accuracy with its Wilson 95 % interval; McNemar's exact test on the samples "
        "only one side answers; the answer's mean log-probability change with a paired bootstrap 95 % interval.",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from mlaq.validate.pairs import compare, load_side

    names: list[str | None] = [None, None]  # each report's reference
    if args.variants:
        names = [n.strip() for n in args.variants.split(",")]
        names = names * 2 if len(names) == 1 else names
        if len(names) != 2 or not all(names):
            raise ValueError(f"--variants takes one name or two, comma-separated; got {args.variants!r}")
    a, b = load_side(args.a, names[0]), load_side(args.b, names[1])
    out = compare(a, b, seed=args.seed)
    sys.stdout.write(json.dumps(out, indent=2) + "\n" if args.json else format_text(out))
    return 0
