"""The tail every ``mlaq validate`` run ends in (local, --stream, --server): the results on stdout (the
table, or one JSON object with --json), the report files with --out, the exit code of --fail-on.

The results are printed first: a failing write of --out cannot lose them. What is printed depends only
on what the report holds (a live server's notes appear because the report names servers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def finish(args: argparse.Namespace, report: dict[str, Any], out: Path | None) -> int:
    """Print the results, write --out, and return the exit code."""
    from mlaq.validate.report import report_json
    from mlaq.validate.summary import print_summary

    if args.json:
        sys.stdout.write(report_json(report))
    else:
        print_summary(report)
        notes = server_notes(report)
        if notes is not None:
            print("\n".join(notes))
    sys.stdout.flush()
    code = verdict_exit_code(report, args.fail_on)
    return code if out is None or save_report(report, out, args.overwrite) else 1


def save_report(report: dict[str, Any], out: Path, overwrite: bool = False) -> bool:
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


def verdict_exit_code(report: dict[str, Any], fail_on: str | None) -> int:
    """0, or 1 when ``--fail-on`` names a verdict some scheme reached (the failing ones on stderr)."""
    if fail_on is None:
        return 0
    failing = {"degraded": {"degraded"}, "inconclusive": {"degraded", "inconclusive"}}[fail_on]
    bad = []
    for name, v in [*report["schemes"].items(), ("as-configured", report.get("as_configured"))]:
        if v is not None and v["verdict"]["verdict"] in failing:
            bad.append(f"{name}: {v['verdict']['verdict']}")
    if bad:
        print(f"mlaq validate: --fail-on {fail_on}: {'; '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


def server_notes(report: dict[str, Any]) -> list[str] | None:
    """Under the table of a run against servers: llama.cpp's KL list of each candidate, the decode path,
    and what a server could not measure (None when the report names no servers)."""
    servers = report["model"].get("servers")
    if servers is None:
        return None
    from mlaq.validate.kld import format_kld_statistics

    lines = []
    for name, v in report["schemes"].items():
        d = v.get("decode") or {}
        if d.get("n"):
            lines += [
                "",
                f"{name}: decode path (greedy positions with equal contexts, n={d['n']}): mean KLD "
                f"{d['kld']['mean']:.6f} ± {d['kld']['uncertainty']:.6f}, max {d['kld']['max']:.6f}, "
                f"same top p {100 * d['top1_agreement']:.3f} %",
            ]
        stats = (v.get("kld_stats") or {}).get("all")
        if stats:
            lines += ["", f"====== {name}: KL divergence statistics (llama.cpp's list) ======"]
            lines += format_kld_statistics(stats)
            est = v.get("kl_estimator") or {}
            if not est.get("exact", True):
                lines.append(
                    f"(top-{report['config']['logprobs']} estimate, a lower bound: reference mass outside the "
                    f"shared top-k set mean {est['mass_outside_mean']:.1e}, max {est['mass_outside_max']:.1e})"
                )
    for side, s in servers.items():
        for what, msg in (s or {}).get("errors", {}).items():
            lines.append(f"{side}: {what}: {msg}")
        for msg in (s or {}).get("warnings", []):
            lines.append(f"{side}: warning: {msg}")
    return lines
