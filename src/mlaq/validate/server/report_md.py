"""report.md and the terminal summary of a server validation (both read only the report dict)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlaq.validate.kld import format_kld_statistics


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _pct(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _server_line(s: dict[str, Any] | None) -> str:
    if s is None:
        return "none (the candidate's own figures only)"
    where = "recorded reference of " if s.get("recording") else ""
    v = s.get("version") or "unknown"
    return (
        f"{where}`{s.get('model')}` at {s.get('url')} (version {v}, max_model_len {s.get('max_model_len')}, "
        f"teacher forcing via {s.get('teacher_forcing') or '—'}, /metrics "
        f"{'with' if s.get('spec_decode_counters') else 'without'} spec-decode counters"
        + ("" if s.get("metrics") else ": absent")
        + ")"
    )


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The short terminal summary: one row per side, then the llama.cpp list."""
    c, ref, cand = report["config"], report["reference"], report["candidate"]
    lines = [
        f"candidate: {_server_line(report['servers']['candidate'])}",
        f"reference: {_server_line(report['servers']['reference'])}",
        f"{c['windows']} x {c['context_len']}-token windows, top-{c['logprobs']} logprobs; "
        f"{c['prompts']} prompts x {c['max_tokens']} greedy tokens",
        "",
        f"{'':<10} {'NLL':>8} {'KL (nats)':>10} {'top-1':>8} {'ΔNLL':>9} {'1st diff':>9} "
        f"{'rep. ' + str(c['ngram']) + '-gram':>12} {'accept':>8} {'mean len':>9}",
    ]
    for label, v in (("reference", ref), ("candidate", cand)):
        if v is None:
            continue
        gen = v.get("generation") or {}
        lines.append(
            f"{label:<10} {_f(v.get('nll'), '.4f'):>8} {_f(v.get('kl'), '.2e'):>10} "
            f"{_pct(v.get('top1_agreement')):>8} {_f(v.get('nll_delta'), '+.4f'):>9} "
            f"{_f(gen.get('first_divergence_mean'), '.1f'):>9} {_pct(gen.get('repeated_ngram_share'), 0):>12} "
            f"{_pct(v.get('acceptance_rate')):>8} {_f(v.get('mean_acceptance_length'), '.2f'):>9}"
        )
    stats = (cand.get("kld_stats") or {}).get("all")
    if stats:
        lines += ["", "====== KL divergence and token probability statistics (llama.cpp's list) ======"]
        lines += format_kld_statistics(stats)
        est = cand["kl_estimator"]
        lines.append(
            "KL estimator: "
            + (
                "exact (whole distributions)"
                if est["exact"]
                else f"top-{c['logprobs']} lower bound; reference mass outside the shared top-k set: mean "
                f"{est['mass_outside_mean']:.2e}, max {est['mass_outside_max']:.2e}"
            )
        )
    for label, v in (("reference", ref), ("candidate", cand)):
        for what, msg in (v or {}).get("errors", {}).items():
            lines.append(f"{label} {what}: {msg}")
        for msg in (v or {}).get("warnings", []):
            lines.append(f"{label} warning: {msg}")
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    c, cand = report["config"], report["candidate"]
    out = [
        "# mlaq validate --server",
        "",
        f"- candidate: {_server_line(report['servers']['candidate'])}",
        f"- reference: {_server_line(report['servers']['reference'])}",
        f"- evaluation text: `{report['eval_text'].get('path')}` (sha256 {str(report['eval_text'].get('sha256'))[:12]}…), "
        f"{c['windows']} windows of {c['context_len']} tokens, {c['prompts']} prompts of {c['prompt_len']} "
        f"tokens x {c['max_tokens']} greedy tokens, seed {report['seed']}",
        "",
        "```",
        *summary_lines(report),
        "```",
        "",
    ]
    by = (cand.get("kld_stats") or {}).get("buckets") or []
    if by:
        out += [
            "## By context position",
            "",
            "| positions | n | mean KLD ± | 99 % KLD | max KLD | RMS Δp | same top p ± | ΔNLL ± | mass outside |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b, outside in zip(by, cand["kl_estimator"]["mass_outside_by_bucket"], strict=True):
            if not b.get("n"):
                continue
            k, dp, st, nl = b["kld"], b["delta_p"], b["same_top_p"], b["nll_delta"]
            out.append(
                f"| {b['range'][0]}–{b['range'][1] - 1} | {b['n']} | {k['mean']:.2e} ± {k['uncertainty']:.1e} "
                f"| {k['quantiles']['99']:.2e} | {k['max']:.2e} | {100 * dp['rms']:.3f} % "
                f"| {100 * st['value']:.2f} ± {100 * st['standard_error']:.2f} % "
                f"| {nl['mean']:+.4f} ± {nl['uncertainty']:.4f} | {_f(outside, '.1e')} |"
            )
        out += ["", cand["kl_estimator"]["note"] + ".", ""]
    return "\n".join(out)


def write_server_report(report: dict[str, Any], out: str | Path) -> list[Path]:
    """report.md and report.json into ``out``, atomically (a failed write keeps the previous ones)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".mlaq-validate-", dir=out))
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot create the directory ({exc.strerror or exc})") from None
    try:
        (tmp / "report.json").write_text(
            json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8"
        )
        (tmp / "report.md").write_text(render_markdown(report), encoding="utf-8")
        for name in ("report.json", "report.md"):
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / "report.json", out / "report.md"]
