"""Report sections shared by every source: llama.cpp's KL statistics, MTP acceptance and free-running
generation, and the header and server notes of a live-server run (``mlaq validate --server``). Read only
the report dict."""

from __future__ import annotations

import math
from typing import Any

from mlaq.validate.kld import format_kld_statistics, pm
from mlaq.validate.topk_kl import estimate_words, logprobs_label


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in body]


def _server(s: dict[str, Any] | None) -> str:
    if s is None:
        return "none: the server's own figures only"
    v = s.get("version") or "unknown"
    where = "recorded run of " if s.get("recording") else ""
    metrics = "absent" if not s.get("metrics") else "with" if s.get("spec_decode_counters") else "without"
    return (
        f"{where}`{s.get('model')}` at {s.get('url')} — version {v}, max_model_len {s.get('max_model_len')}, "
        f"teacher forcing via {s.get('teacher_forcing') or '—'}, /metrics {metrics}"
        + (" spec-decode counters" if s.get("metrics") else "")
        + (f", acceptance from {s['acceptance_source']}" if s.get("acceptance_source") else "")
        + "".join(f"; {what.replace('_', ' ')} via {api}" for what, api in (s.get("apis") or {}).items())
    )


def server_header(r: dict[str, Any], cap: str) -> list[str]:
    m, e, c, v = r["model"], r["eval_text"], r["config"], r["versions"]
    servers = m.get("servers") or {}
    lines = [
        "# mlaq validate --server",
        "",
        "A live deployment measured against a reference deployment (or a recorded reference run) on the "
        "same token ids: teacher-forced next-token distributions, free-running greedy text, MTP acceptance.",
        "",
        f"- **Candidate**: {_server(servers.get('candidate'))}",
        f"- **Reference**: {_server(servers.get('reference'))}"
        + (f" (recording `{c['against']}`)" if c.get("against") else ""),
        f"- **Evaluation text**: `{e.get('path')}` ({e.get('bytes')} bytes, {e.get('tokens')} tokens, sha256 "
        f"`{str(e.get('sha256'))[:16]}…`); windows at token offsets {e.get('window_starts')}, prompts at "
        f"{e.get('prompt_starts')}",
        f"- **Run**: {cap}; {c['buckets']} position buckets; {c['concurrency']} requests in flight",
        f"- **Versions**: mlaq {v['mlaq']}, python {v['python']}; {v['platform']}",
        "",
    ]
    return lines


def server_summary(r: dict[str, Any], table: str) -> list[str]:
    """The summary table of a server run and what its columns mean there."""
    n = r["config"]["ngram"]
    return [
        "## Summary",
        "",
        table,
        "",
        "- **KL / top-1 / ΔNLL**: teacher-forced through the servers' prompt log-probabilities (the "
        "prefill path), KL estimated from the top-k log-probabilities (see below); "
        f"**1st diff**, **rep. {n}-gram**: greedy generation; **accept / mean len**: MTP "
        "acceptance as vLLM computes it. Per-layer and per-op errors need the weights: run local "
        "`mlaq validate` on the checkpoint for those.",
        "",
    ]


def server_notes(r: dict[str, Any]) -> list[str]:
    """What a server could not measure, and warnings (other traffic, ids recovered from text)."""
    out = []
    for side, s in (r["model"].get("servers") or {}).items():
        if not s:
            continue
        out += [f"- {side}: {what}: {msg}" for what, msg in s.get("errors", {}).items()]
        out += [f"- {side}: warning: {msg}" for msg in s.get("warnings", [])]
    return ["## What could not be measured", "", *out, ""] if out else []


def decode_section(r: dict[str, Any]) -> list[str]:
    """A server run's decode-path comparison (generated tokens while both contexts are equal)."""
    rows = [(label, v["decode"]) for label, v in r.rows if v.get("decode")]
    if not rows:
        return []
    lines = [
        "## Decode path (the absorbed BMMs)",
        "",
        "Prompt log-probabilities come from the prefill, which in vLLM (and in mlaq under "
        "`decode_only`) runs kv_b_proj directly, not the absorbed BMMs that the FP8/FP4 BMM flags "
        "re-quantize: a BMM bug can hide there. These figures compare the distributions of the greedy "
        "tokens both servers generated, at generated positions 1…f (f: the first differing token; "
        "position 0 comes from the prefill), where both still share their whole context.",
        "",
    ]
    head = ["candidate", "positions", "mean KLD ±", "median", "99 %", "max", "top-1", "KL estimate"]
    body = []
    for label, d in rows:
        if not d.get("n"):
            body.append([label, "0", "—", "—", "—", "—", "—", "—"])
            continue
        k, est = d["kld"], d["kl_estimator"]
        body.append(
            [
                label,
                str(d["n"]),
                f"{k['mean']:.2e} {pm(k['uncertainty'], d['n'], '.1e')}",
                f"{k['median']:.2e}",
                f"{k['quantiles']['99']:.2e}",
                f"{k['max']:.2e}",
                f"{100 * d['top1_agreement']:.2f} %",
                estimate_words(est, r["config"].get("logprobs", -1))
                + ("" if est["exact"] else f", mass outside {est['mass_outside_mean']:.1e}"),
            ]
        )
    return [*lines, *_table(head, body), ""]


def mc_kl_section(r: dict[str, Any]) -> list[str]:
    """--mc-kl: the Monte-Carlo KL estimators beside the top-k figure at the same positions."""
    rows = [(label, v["mc_kl"]) for label, v in r.rows if v.get("mc_kl")]
    if not rows:
        return []
    k = r["config"].get("logprobs", -1)
    lines = [
        "## KL without top-k truncation (Monte Carlo)",
        "",
        "Continuations sampled from the reference at temperature 1, the same tokens scored teacher-forced on "
        "both servers; with r = q(x) / p(x) of each sampled token, **k1** = -log r and **k3** = (r - 1) - "
        "log r are both unbiased estimates of KL(reference ‖ candidate) per token (k3 >= 0, lower variance). "
        "Intervals: bootstrap 95 % over continuations (n/a below "
        f"{rows[0][1]['min_sequences']} continuations). Beside them, the {logprobs_label(k)} figure at the "
        "same positions: exact only when every position returned whole distributions, else a lower bound.",
        "",
    ]
    body = []
    for label, m in rows:
        k1, k3 = m["k1"], m["k3"]
        topk = m.get("topk_kl")
        words = (
            "exact"
            if m.get("topk_is_exact")
            else f"lower bound, exact at {100 * m['topk_exact_share']:.1f} %"
        )
        body.append(
            [
                label,
                f"{k1['sequences']} / {k1['positions']}",
                _mc(k1),
                _mc(k3),
                "—" if topk is None else f"{topk:.3e} ({words})",
            ]
        )
    head = ["candidate", "continuations / tokens", "k1 [95 % CI]", "k3 [95 % CI]", f"{logprobs_label(k)} KL"]
    return [*lines, *_table(head, body), ""]


def _mc(e: dict[str, Any]) -> str:
    ci = e.get("ci")
    return f"{e['kl']:.3e} " + ("[n/a]" if ci is None else f"[{ci[0]:.3e}, {ci[1]:.3e}]")


def kld_section(r: dict[str, Any]) -> list[str]:
    """llama.cpp's ``perplexity --kl-divergence`` list per candidate, overall and by context position."""
    rows = [(label, v) for label, v in r.rows if (v.get("kld_stats") or {}).get("all")]
    if not rows:
        return []
    path = (
        "Teacher-forced through the servers' prompt log-probabilities, i.e. the prefill path (see the "
        "decode-path section for the absorbed BMMs). "
        if r["model"].get("servers") is not None
        else "Teacher-forced with the absorbed (decode) path. "
    )
    lines = [
        "## KL divergence and token probability statistics (llama.cpp's list)",
        "",
        path + "As `llama-perplexity --kl-divergence` prints them, over every predicted position whose "
        "next token is known (KLD in nats; Δp = change of the actual next token's probability; same top "
        "p = top-1 agreement; ± is the standard error), then by context position.",
        "",
    ]
    for label, v in rows:
        lines += [f"### {label}", "", "```", *format_kld_statistics(v["kld_stats"]["all"]), "```", ""]
        est = v.get("kl_estimator")
        if est is not None:
            lines += [
                f"KL estimator: {est['note']}. This figure: "
                f"{estimate_words(est, r['config'].get('logprobs', -1))}; "
                f"reference mass outside the shared top-k set: mean {est['mass_outside_mean']:.2e}, max "
                f"{est['mass_outside_max']:.2e}.",
                "",
            ]
        body = []
        for b in v["kld_stats"]["buckets"]:
            if not b.get("n"):
                continue
            k, dp, st, nl = b["kld"], b["delta_p"], b["same_top_p"], b["nll_delta"]
            body.append(
                [
                    f"{b['range'][0]}–{b['range'][1] - 1}",
                    str(b["n"]),
                    f"{k['mean']:.2e} {pm(k['uncertainty'], b['n'], '.1e')}",
                    f"{k['median']:.2e}",
                    f"{k['quantiles']['99']:.2e}",
                    f"{k['max']:.2e}",
                    f"{100 * dp['rms']:.3f} %",
                    f"{100 * st['value']:.2f} {pm(100 * st['standard_error'], b['n'], '.2f')} %",
                    f"{nl['mean']:+.4f} {pm(nl['uncertainty'], b['n'], '.4f')}",
                ]
            )
        head = ["positions", "n", "mean KLD", "median", "99 %", "max", "RMS Δp", "same top p", "ΔNLL"]
        lines += [*_table(head, body), ""]
    return lines


def acceptance(r: dict[str, Any]) -> list[str]:
    k = r["config"]["num_speculative_tokens"]
    if not k:
        why = (
            "the servers reported none"
            if r["model"].get("servers") is not None
            else "--num-speculative-tokens 0"
        )
        return ["## MTP speculative decoding", "", f"Not run ({why}).", ""]
    head = ["scheme", "drafts", "draft tokens", "accepted", "mean len", "avg rate", "± 1 SE"]
    head += [f"pos {i}" for i in range(k)]
    body = []
    for label, v in r.rows:
        per = v.get("per_position_acceptance_rate") or []
        p, n = v["acceptance_rate"], v["num_draft_tokens"]
        se = math.sqrt(p * (1 - p) / n) if p is not None and n else None
        body.append(
            [
                label,
                str(v["num_drafts"]),
                str(n),
                str(v["num_accepted_tokens"]),
                "—" if v["mean_acceptance_length"] is None else f"{v['mean_acceptance_length']:.2f}",
                _pct(p, 1),
                _pct(se, 1),
                *(_pct(x, 1) for x in per),
            ]
        )
    note = (
        "Greedy drafts and greedy verification; draft (MTP layer) and target both run the scheme. "
        "± 1 SE is the binomial standard error of the rate: once a generation diverges from the "
        "reference's, acceptance is measured on other text, so differences within about two SE are "
        "sampling noise (compare the noise floor's row)."
    )
    return ["## MTP speculative decoding", "", note, "", *_table(head, body), ""]


def generation(r: dict[str, Any]) -> list[str]:
    n = r["config"]["ngram"]
    head = ["scheme", "first differing token per prompt", f"repeated {n}-grams", "longest loop"]
    body = []
    for label, v in r.rows:
        g = v.get("generation") or {}
        firsts = g.get("first_divergence")
        first = "reference" if firsts is None else ", ".join("same" if f is None else str(f) for f in firsts)
        body.append([label, first, _pct(g.get("repeated_ngram_share"), 1), str(g.get("longest_loop", "—"))])
    lines = ["## Free-running greedy generation", "", *_table(head, body), ""]
    lines += ["First prompt, its last tokens:", "", "```", r["eval_text"]["prompt_sample"], "```", ""]
    ref_sample = r["reference"].get("sample")
    for label, v in r.rows:
        if "sample" not in v:
            continue
        if v is not r["reference"] and v["sample"] == ref_sample:
            lines += [f"{label}: identical to the reference.", ""]
        else:
            lines += [f"{label}:", "", "```", v["sample"], "```", ""]
    return lines
