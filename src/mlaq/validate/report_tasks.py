"""report.md's long-context evidence: the verdict per scheme, the task-suite tables and the
attention flip rate. Read only the report dict (``stats.summarize``); each section is [] when the run
measured nothing for it."""

from __future__ import annotations

from typing import Any


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in body]


def _pct(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _candidates(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(label, v) for label, v in r.rows if v.get("verdict")]


def verdict_section(r: dict[str, Any]) -> list[str]:
    """Per scheme: ok / degraded / inconclusive against bf16, why, and the smallest detectable drop."""
    rows = _candidates(r)
    if not rows:
        return []
    vc = r.get("verdict_config") or {}
    lines = [
        "## Verdict",
        "",
        f"Against bf16 on the same samples: **degraded** when a task cell loses accuracy with a Holm-adjusted "
        f"exact McNemar p < {vc.get('alpha', 0.05):g}, when its answer log-probability falls by more than "
        f"{vc.get('max_logprob_drop', 0.1):g} nats with the whole 95 % interval below, when mean KL exceeds "
        f"{vc.get('max_kl', 0.01):g} nats, or when MTP acceptance leaves {vc.get('acceptance_low', 0.95):g}–"
        f"{vc.get('acceptance_high', 1.2):g} x bf16 (with >= {vc.get('min_prompts', 5)} prompts, the whole paired "
        "bootstrap 95 % interval over prompts beyond the bound); a task bf16 itself cannot do (its accuracy "
        "below the smallest drop the run could detect) is **not measurable on this model** and the verdict "
        "rests on the others; **ok** when nothing is degraded and every measured task excludes a drop: the "
        f"run could detect an accuracy drop of {_pct(vc.get('max_drop', 0.05))} (alpha 0.05, power 0.8), or "
        "the whole paired 95 % interval of the answer log-probability's change lies above "
        f"-{vc.get('max_logprob_drop', 0.1):g} nats (n >= {vc.get('min_equivalence_samples', 16)}); "
        "**inconclusive** otherwise. The smallest detectable drop is the largest over the measured tasks: "
        "a smaller drop may be there unseen.",
        "",
    ]
    body = []
    for label, v in rows:
        vd = v["verdict"]
        ratio, ci = vd.get("acceptance_ratio"), vd.get("acceptance_ratio_ci")
        shown = (
            "—" if ratio is None else f"{ratio:.2f}" + ("" if ci is None else f" ({ci[0]:.2f}-{ci[1]:.2f})")
        )
        body.append(
            [
                label,
                f"**{vd['verdict']}**",
                _pct(vd.get("min_detectable_drop")) if vd.get("min_detectable_drop") is not None else "—",
                shown,
                "; ".join(vd["reasons"]) or "—",
            ]
        )
    head = ["scheme", "verdict", "smallest detectable drop", "acceptance / bf16 (95 % CI)", "why"]
    return [*lines, *_table(head, body), ""]


def _suite_intro(r: dict[str, Any]) -> list[str]:
    s = r["tasks"]
    c, h = s["config"], s["haystack"]
    wrapped = " (repeated to fill the longest samples)" if h.get("wrapped") else ""
    skipped = f" Skipped: {'; '.join(c['skipped'])}." if c.get("skipped") else ""
    return [
        "## Long-context tasks",
        "",
        f"RULER-style tasks ({', '.join(c.get('tasks', []))}) at lengths {c.get('lengths')} tokens, "
        f"{_samples(c)} samples per length ({s['samples']} in all, {s['seconds']:.1f} s), hidden "
        f"in `{h.get('path')}` ({h.get('tokens')} tokens{wrapped}); needle depths {c.get('depths')}; seed "
        f"{c.get('seed')}.{skipped} Scored by greedy exact match of the answer tokens (accuracy, Wilson 95 % "
        "interval) and by the answer's mean log-probability under teacher forcing; every scheme runs on the "
        "SAME samples as bf16: McNemar's exact p-value for the accuracy difference, a paired bootstrap 95 % "
        "interval for the log-probability difference (nats; negative = the scheme is less sure of the answer) "
        "and for the token accuracy difference (the share of answer tokens that are their position's argmax: "
        "partial credit for a long answer such as copy's segment).",
        "",
    ]


def _samples(c: dict[str, Any]) -> str:
    per = dict(c.get("per_task") or [])
    tasks = c.get("tasks", [])
    if not per:
        return str(c.get("samples"))
    return ", ".join(f"{t} {per.get(t, c.get('samples'))}" for t in tasks)


def tasks_section(r: dict[str, Any]) -> list[str]:
    """One table per task: accuracy with its interval and n, and the paired comparison with bf16."""
    if not r.get("tasks"):
        return []
    rows = [(label, v) for label, v in r.rows if v.get("tasks")]
    if not rows:
        return []
    lines = _suite_intro(r)
    head = ["scheme", "length", "n", "accuracy [95 % CI]", "Δ vs bf16", "McNemar p", "answer log-prob"]
    head += ["Δ log-prob [95 % CI]", "token accuracy (Δ [95 % CI])"]
    for task in rows[0][1]["tasks"]:
        body = []
        for label, v in rows:
            for length, c in (v["tasks"].get(task) or {}).items():
                paired = "accuracy_delta" in c
                lo, hi = c["logprob_delta_ci"] if paired else (None, None)
                body.append(
                    [
                        label,
                        length,
                        str(c["n"]),
                        f"{_pct(c['accuracy'])} [{_pct(c['ci_low'])}–{_pct(c['ci_high'])}]",
                        f"{100 * c['accuracy_delta']:+.0f} pts" if paired else "—",
                        f"{c['p_value_vs_bf16']:.3g}" if paired else "—",
                        f"{c['logprob']:.3f}",
                        f"{c['logprob_delta']:+.3f} [{lo:+.3f}, {hi:+.3f}]" if paired else "—",
                        _token_accuracy(c),
                    ]
                )
        lines += [f"### {task}", "", *_table(head, body), ""]
    return lines + needle_section(r) + trend_section(r)


def trend_section(r: dict[str, Any]) -> list[str]:
    """Per scheme and task: does the paired drop grow with length (slope per doubling, longest minus
    shortest, stratified bootstrap 95 % intervals), with the one-sentence answer."""
    rows = [(label, v["length_trend"]) for label, v in r.rows if v.get("length_trend")]
    if not rows:
        return []
    lines = [
        "### does the drop grow with length?",
        "",
        "The paired drop against bf16 (accuracy in points; answer log-probability in nats) regressed on "
        "log2(length) over every sample (least squares: the growth per doubling of the context), and the "
        "longest length's mean drop minus the shortest's; 95 % intervals from a bootstrap that resamples "
        "the samples within each length.",
        "",
    ]
    head = ["scheme", "task", "figure", "n per length", "slope per doubling [95 % CI]"]
    head += ["longest − shortest [95 % CI]"]
    body, answers = [], []
    for label, by_task in rows:
        for task, figures in by_task.items():
            for figure, t in figures.items():
                fmt = (lambda x: f"{100 * x:+.1f} pts") if t["unit"] == "pts" else (lambda x: f"{x:+.3f}")
                lo, hi = t["slope_ci"]
                dlo, dhi = t["longest_minus_shortest_ci"]
                body.append(
                    [
                        label,
                        task,
                        figure,
                        "/".join(str(n) for n in t["n"]),
                        f"{fmt(t['slope_per_doubling'])} [{fmt(lo)}, {fmt(hi)}]",
                        f"{fmt(t['longest_minus_shortest'])} [{fmt(dlo)}, {fmt(dhi)}]",
                    ]
                )
            answers.append(f"- {label}, {task} accuracy: {figures['accuracy']['answer']}")
    return [*lines, *_table(head, body), "", *answers, ""]


def _token_accuracy(c: dict[str, Any]) -> str:
    tok = c.get("token_accuracy")
    if tok is None:
        return "—"
    if "token_accuracy_delta" not in c:
        return _pct(tok)
    lo, hi = c["token_accuracy_delta_ci"]
    return f"{_pct(tok)} ({100 * c['token_accuracy_delta']:+.0f} pts [{100 * lo:+.0f}, {100 * hi:+.0f}])"


def needle_section(r: dict[str, Any]) -> list[str]:
    """Needle accuracy by depth (columns) x length (rows), per variant."""
    rows = [(label, v["needle_by_depth"]) for label, v in r.rows if v.get("needle_by_depth")]
    if not rows:
        return []
    lines = [
        "### needle by depth",
        "",
        "Accuracy (samples) by where the fact sits: depth 0 = the start of the context, 1 = just before "
        "the question.",
        "",
    ]
    for label, by_len in rows:
        depths = sorted({d for cells in by_len.values() for d in cells}, key=float)
        body = [[length, *(_cell(cells.get(d)) for d in depths)] for length, cells in by_len.items()]
        lines += [f"{label}:", "", *_table(["length", *(f"depth {d}" for d in depths)], body), ""]
    return lines


def _cell(c: dict[str, Any] | None) -> str:
    return "—" if c is None else f"{_pct(c['accuracy'])} ({c['n']})"


def flips_section(r: dict[str, Any]) -> list[str]:
    """Per layer and number of competing keys: top-key flip rate, flip rate of retrieval-like rows, TV."""
    rows = [(label, v) for label, v in r.rows if v.get("flip_rate")]
    if not rows:
        return []
    lines = [
        "## Attention flip rate",
        "",
        "On the reference's captured inputs, each sampled query's attention row is computed with bf16's "
        "W_UK and with the scheme's (BMM #1), over the same keys. Per (query, head): a **flip** when the "
        "highest-weighted key differs; **retrieval** rows are those whose bf16 top key holds >= 50 % of the "
        "weight (a head that fetches one token: what a needle depends on), their count in brackets; **TV** "
        "is the total-variation distance between the two rows. Columns: queries competing over up to that "
        "many keys, so a rate that grows to the right grows with context length.",
        "",
    ]
    for label, v in rows:
        flips, retr, tv = v["flip_rate"], v.get("flip_rate_retrieval") or {}, v.get("attention_tv") or {}
        counts = v.get("retrieval_rows") or {}
        keys = list(next(iter(flips.values())))
        body = []
        for layer, by_keys in flips.items():
            n = counts.get(layer) or {}
            body += [
                [layer, "flip", *(_pct(by_keys.get(k), 2) for k in keys)],
                [
                    layer,
                    "retrieval flip",
                    *(_retrieval((retr.get(layer) or {}).get(k), n.get(k)) for k in keys),
                ],
                [layer, "TV", *(_num((tv.get(layer) or {}).get(k)) for k in keys)],
            ]
        lines += [f"### {label}", "", *_table(["layer", "figure", *(f"≤ {k} keys" for k in keys)], body), ""]
    return lines


def _retrieval(x: float | None, rows: float | None) -> str:
    return _pct(x, 2) if rows is None else f"{_pct(x, 2)} ({rows:.0f})"


def _num(x: float | None) -> str:
    return "—" if x is None else f"{x:.2e}"
