"""The tail every ``mlaq validate`` run ends in (local, --stream, --server): the results on stdout (the
table, or one JSON object with --json), the report files with --out, the exit code of --fail-on.

The results are printed first: a failing write of --out cannot lose them. What is printed depends only
on what the report holds (a live server's notes appear because the report names servers).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def finish(args: argparse.Namespace, report: Mapping[str, Any], out: Path | None) -> int:
    """Print the results, write --out, and return the exit code."""
    from mlaq.validate.report import report_json
    from mlaq.validate.summary import print_summary

    notes = None if args.json else server_notes(report)
    bad = failing(report, args.fail_on)
    if args.json:
        sys.stdout.write(report_json(report))
    else:
        print_summary(report)
        if notes is not None:
            print("\n".join(notes))
    sys.stdout.flush()
    if bad:
        print(f"mlaq validate: --fail-on {args.fail_on}: {'; '.join(bad)}", file=sys.stderr)
    code = 1 if bad else 0
    return code if out is None or save_report(report, out, args.overwrite) else 1


def save_report(report: Mapping[str, Any], out: Path, overwrite: bool = False) -> bool:
    """Write the report files into ``out`` (after the results were printed); a failing write is one
    line naming --out, and False."""
    from mlaq.validate.report import write_report

    try:
        paths = write_report(report, out, overwrite=overwrite)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(
            f"mlaq validate: --out {out}: could not write the report ({why}); the results above are "
            "complete and a previous report there stays as it was",
            file=sys.stderr,
        )
        return False
    print(f"mlaq validate: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return True


def failing(report: Mapping[str, Any], fail_on: str | None) -> list[str]:
    """'scheme: verdict' of each scheme whose verdict ``--fail-on`` names (exit 1 when any)."""
    if fail_on is None:
        return []
    verdicts = {"degraded": {"degraded"}, "inconclusive": {"degraded", "inconclusive"}}[fail_on]
    bad = []
    for name, v in [*report["schemes"].items(), ("as-configured", report.get("as_configured"))]:
        if v is not None and v["verdict"]["verdict"] in verdicts:
            bad.append(f"{name}: {v['verdict']['verdict']}")
    return bad


def server_notes(report: Mapping[str, Any]) -> list[str] | None:
    """Under the table of a run against servers: llama.cpp's KL list of each candidate, the decode path,
    the KL estimators (each figure named by the one it comes from), and what a server could not measure
    (None when the report names no servers)."""
    servers = report["model"].get("servers")
    if servers is None:
        return None
    from mlaq.validate.kld import format_kld_statistics, pm
    from mlaq.validate.topk_kl import estimate_words

    k = report["config"]["logprobs"]
    lines = []
    for name, v in report["schemes"].items():
        d = v.get("decode") or {}
        if d.get("n"):
            lines += [
                "",
                f"{name}: decode path (greedy positions with equal contexts, n={d['n']}): mean KLD "
                f"{d['kld']['mean']:.6f} {pm(d['kld']['uncertainty'], d['n'], '.6f')}, max {d['kld']['max']:.6f}, "
                f"same top p {100 * d['top1_agreement']:.3f} % (KL: {estimate_words(d['kl_estimator'], k)})",
            ]
        stats = (v.get("kld_stats") or {}).get("all")
        if stats:
            lines += ["", f"====== {name}: KL divergence statistics (llama.cpp's list) ======"]
            lines += format_kld_statistics(stats)
            est = v.get("kl_estimator") or {}
            note = f"(KL: {estimate_words(est, k)}"
            if not est.get("exact", True):
                note += (
                    f"; reference mass outside the shared top-k set mean {est['mass_outside_mean']:.1e}, "
                    f"max {est['mass_outside_max']:.1e}"
                )
            lines.append(note + ")")
        lines += _mc_lines(name, v.get("mc_kl"), k)
    for side, s in servers.items():
        for what, msg in (s or {}).get("errors", {}).items():
            lines.append(f"{side}: {what}: {msg}")
        for msg in (s or {}).get("warnings", []):
            lines.append(f"{side}: warning: {msg}")
    return lines


def _mc_lines(name: str, m: dict[str, Any] | None, k: int) -> list[str]:
    """--mc-kl's figures, each named by its estimator."""
    if not m:
        return []
    from mlaq.validate.topk_kl import logprobs_label

    def fig(e: dict[str, Any]) -> str:
        ci = e["ci"]
        return f"{e['kl']:.4f} " + (
            "[95 % CI n/a: too few continuations]" if ci is None else f"[{ci[0]:.4f}, {ci[1]:.4f}]"
        )

    k1, k3 = m["k1"], m["k3"]
    words = (
        "exact"
        if m["topk_is_exact"]
        else f"a lower bound; exact at {100 * m['topk_exact_share']:.1f} % of them"
    )
    topk = (
        ""
        if m["topk_kl"] is None
        else f"; {logprobs_label(k)} KL at the same positions {m['topk_kl']:.4f} ({words})"
    )
    return [
        "",
        f"{name}: KL(reference || candidate) by Monte Carlo over {k1['sequences']} sampled continuations "
        f"({k1['positions']} tokens): k1 (log-ratio) {fig(k1)}, k3 ((r - 1) - log r) {fig(k3)} nats/token{topk}",
    ]
