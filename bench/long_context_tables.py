"""docs/long-context.md's teacher-forced and generation tables, rendered from a `mlaq validate --out DIR`
run's report.json (the long-window run: `--tasks none --context-len 16384 --windows 1 ...`).

    python bench/long_context_tables.py DIR/report.json

Prints markdown:
- KL(bf16 || variant) by context position bucket, per variant (the fp32 noise floor first): the mean over
  the bucket's positions with a 95 % interval (1.96 x llama.cpp's uncertainty of the mean, which treats
  positions as independent), then the last bucket minus the first with its interval the same way;
- the attention top-key flip rate by the number of keys a query competes over, per scheme, pooled over
  the main layers (and per layer for the scheme that flips most), with Wilson 95 % intervals and n
  (sampled query rows x heads; rows of one window are not independent: read the intervals as a floor);
- MTP acceptance and the repeated n-gram share of the free generations, per variant, with Wilson 95 %
  intervals over draft tokens and n-grams, and the paired ratio of acceptance against bf16 with its
  bootstrap interval over prompts.
Reads only report.json's documented fields; no model is loaded.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mlaq.validate.flips import sample_rows
from mlaq.validate.intervals import Z95, wilson


def variants(report: dict) -> list[tuple[str, dict]]:
    out = [] if report.get("noise_floor") is None else [("fp32 (floor)", report["noise_floor"])]
    return out + list(report["schemes"].items())


def _label(lo: int, hi: int) -> str:
    return f"{lo // 1024}K-{hi // 1024}K" if lo % 1024 == 0 and hi % 1024 == 0 else f"{lo}-{hi}"


def kl_table(report: dict) -> list[str]:
    buckets = report["buckets"]
    head = ["variant", *(_label(lo, hi) for lo, hi in buckets), "last - first"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in variants(report):
        cells = []
        stats = v["kld_stats"]["buckets"]
        for b in stats:
            m, u = b["kld"]["mean"], b["kld"]["uncertainty"]
            cells.append(f"{m:.2e} [{m - Z95 * u:.2e}, {m + Z95 * u:.2e}]")
        first, last = stats[0]["kld"], stats[-1]["kld"]
        d = last["mean"] - first["mean"]
        se = math.hypot(last["uncertainty"], first["uncertainty"])
        cells.append(f"{d:+.2e} [{d - Z95 * se:+.2e}, {d + Z95 * se:+.2e}]")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    n = report["buckets"][0][1] - report["buckets"][0][0]
    rows.append(f"\nn = {n} positions per bucket per window, {report['config']['windows']} window(s).")
    return rows


def flip_counts(report: dict, v: dict, layer: str) -> list[tuple[float, int]]:
    """(flips, rows x heads) per bucket of layer ``layer``; rows from validate's own row sampling."""
    cfg, heads = report["config"], report["model"]["num_attention_heads"]
    mtp = int(layer) >= report["model"]["num_hidden_layers"]
    rows = sample_rows(cfg["context_len"] - int(mtp), cfg.get("flip_rows", 256)).tolist()
    out = []
    for lo, hi in report["buckets"]:
        n = heads * sum(lo <= r < hi for r in rows) * cfg["windows"]
        rate = v["flip_rate"][layer].get(str(hi))
        out.append((0.0 if rate is None else rate * n, n))
    return out


def _rate_cell(k: float, n: int) -> str:
    if n == 0:
        return "-"
    lo, hi = wilson(round(k), n)
    return f"{100 * k / n:.1f} % [{100 * lo:.1f}, {100 * hi:.1f}]"


def flip_table(report: dict) -> list[str]:
    main = [str(i) for i in range(report["model"]["num_hidden_layers"])]
    head = ["scheme", *(_label(lo, hi) for lo, hi in report["buckets"])]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    worst, worst_rate, n_cell = None, -1.0, 0
    for name, v in report["schemes"].items():
        if "flip_rate" not in v:
            continue
        per_layer = [flip_counts(report, v, layer) for layer in main]
        pooled = [
            (sum(c[i][0] for c in per_layer), sum(c[i][1] for c in per_layer)) for i in range(len(head) - 1)
        ]
        rows.append(f"| {name} | " + " | ".join(_rate_cell(k, n) for k, n in pooled) + " |")
        total = sum(k for k, _ in pooled) / max(1, sum(n for _, n in pooled))
        if total > worst_rate:
            worst, worst_rate = name, total
        n_cell = pooled[0][1]
    rows.append(f"\nn = {n_cell} (query row, head) pairs per cell, layers 0-{len(main) - 1} pooled.")
    if worst is not None:
        v = report["schemes"][worst]
        rows += ["", f"{worst} by layer:", "", "| layer | " + " | ".join(head[1:]) + " |"]
        rows.append("|" + "---|" * len(head))
        for layer in v["flip_rate"]:
            cells = [_rate_cell(k, n) for k, n in flip_counts(report, v, layer)]
            mtp = " (MTP)" if int(layer) >= len(main) else ""
            rows.append(f"| {layer}{mtp} | " + " | ".join(cells) + " |")
    return rows


def generation_table(report: dict) -> list[str]:
    cfg = report["config"]
    k, ngram = cfg["num_speculative_tokens"], cfg["ngram"]
    head = [
        "variant",
        f"MTP acceptance (k={k}) [95 %], draft tokens",
        "ratio to bf16 [95 %]",
        f"repeated {ngram}-gram share [95 %], n-grams",
        "per prompt",
        "identical to bf16",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in [("bf16", report["reference"]), *variants(report)]:
        drafts, accepted = v.get("num_draft_tokens"), v.get("num_accepted_tokens")
        acc = "-" if not drafts else f"{_rate_cell(accepted, drafts)}, {drafts}"
        ci = v.get("acceptance_ratio_ci")
        ratio = (
            "-"
            if ci is None
            else f"{accepted / drafts / report['reference']['acceptance_rate']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
        )
        gen = v["generation"]
        shares = gen["per_prompt_repeated_ngram_share"]
        per = max(0, cfg["max_tokens"] - ngram + 1)  # n-grams per generation (EOS is ignored)
        rep = sum(round(s * per) for s in shares)
        same = gen.get("identical_generations")
        rows.append(
            f"| {name} | {acc} | {ratio} | {_rate_cell(rep, per * len(shares))}, {per * len(shares)} | "
            + ", ".join(f"{100 * s:.1f} %" for s in shares)
            + f" | {'-' if same is None else f'{same} of {len(shares)}'} |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="report.json of the long-window mlaq validate run")
    report = json.loads(parse_path(parser.parse_args(argv).report).read_text())
    cfg = report["config"]
    windows = f"{cfg['windows']} teacher-forced window(s), " if "buckets" in report else ""
    print(
        f"context {cfg['context_len']}, {windows}{cfg['prompts']} prompts of {cfg['prompt_len']} tokens, "
        f"{cfg['max_tokens']} generated each\n"
    )
    for title, table, present in (
        ("KL(bf16 || variant) by context position, nats: mean [95 %]", kl_table, "buckets" in report),
        ("Attention top-key flip rate by competing keys", flip_table, _has_flips(report)),
        ("Free generation after the long prompts", generation_table, "generation" in report["reference"]),
    ):
        if present:
            print(f"**{title}**\n")
            print("\n".join(table(report)) + "\n")
    return 0


def _has_flips(report: dict) -> bool:
    return any("flip_rate" in v for v in report["schemes"].values())


def parse_path(path: Path) -> Path:
    if not path.is_file():
        raise SystemExit(f"{path}: no such file; pass the report.json of a `mlaq validate --out DIR` run")
    return path


if __name__ == "__main__":
    raise SystemExit(main())
