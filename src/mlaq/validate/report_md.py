"""report.md: the summary table, each scheme's arithmetic, theory vs measurement, and the detail tables."""

from __future__ import annotations

from typing import Any

from mlaq.validate import report_sections as sections
from mlaq.validate import report_tasks as tasks
from mlaq.validate.report_stream import stream_section
from mlaq.validate.report_types import Report
from mlaq.validate.summary import caption, format_markdown

PLOTS = {
    "error_vs_position.png": "Error vs context position (per-layer attention error, KL, ΔNLL)",
    "acceptance_per_position.png": "MTP per-position acceptance rate",
    "per_layer_error.png": "Attention error by layer",
    "task_accuracy.png": "Task accuracy vs length, Wilson 95 % bands",
    "task_logprob_delta.png": "Answer log-prob difference vs bf16 by length, bootstrap 95 % bands",
    "needle_depth_length.png": "Needle accuracy by depth x length",
    "flip_rate_vs_keys.png": "Attention top-key flip rate vs competing keys, per layer",
}


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in body]


def _header(r: dict[str, Any], cap: str) -> list[str]:
    m, e, c, v = r["model"], r["eval_text"], r["config"], r["versions"]
    lines = [
        "# mlaq validate",
        "",
        "What re-quantizing MLA's absorbed BMMs (kv_b_proj's W_UK and W_UV, every MLA layer including "
        "the MTP layer) costs, against the bf16 reference on the same weights, inputs and seeds.",
        "",
        f"- **Model**: `{m['path']}` — {m['model_type']}, {m['num_hidden_layers']} layers + "
        f"{m['num_mtp_layers']} MTP, {m['num_attention_heads']} heads, kv_lora_rank {m['kv_lora_rank']}, "
        f"qk_nope {m['qk_nope_head_dim']}, qk_rope {m['qk_rope_head_dim']}, v {m['v_head_dim']}, context "
        f"{m['max_position_embeddings']}, checkpoint dtype {m['checkpoint_dtype']}",
        f"- **Evaluation text**: `{e['path']}` ({e['bytes']} bytes, {e['tokens']} tokens, sha256 "
        f"`{e['sha256'][:16]}…`); windows at token offsets {e['window_starts']}, prompts at "
        f"{e['prompt_starts']}",
        f"- **Run**: {cap}; {c['buckets']} position buckets; torch threads {c['threads']}",
        f"- **Seed**: {r['seed']} (chooses windows and prompts; seeds the engine; decoding is greedy)",
        f"- **Versions**: mlaq {v['mlaq']}, torch {v['torch']}, python {v['python']}, "
        f"tokenizers {v.get('tokenizers', '—')}; {v['platform']}",
    ]
    if c["as_configured"]:
        lines.append(
            f"- **As configured**: settings {c['settings']}, --quantization-config "
            f"`{c['quantization_config'] or 'none'}`"
            + (
                " with --quantization online (vLLM's meaning: the kv_b_proj linear, prefill and decode)"
                if c.get("quantization") == "online"
                else ""
            )
        )
    return [*lines, ""]


def _summary(r: dict[str, Any], table: str) -> list[str]:
    n = r["config"]["ngram"]
    return [
        "## Summary",
        "",
        table,
        "",
        "- **attn err**: relative RMS error of each layer's attention output (after o_proj) on the reference's "
        "captured inputs, mean over layers (MTP included). **BMM err**: the larger of the two BMMs' "
        "per-op errors, with the alignment-scaled theory in brackets (see below).",
        "- **KL**: KL(reference ‖ scheme) of next-token distributions, teacher-forced with the absorbed "
        "(decode) path over whole windows; **top-1**: argmax agreement; **ΔNLL**: change of the "
        "next token's NLL (positive = worse).",
        f"- **1st diff**: mean index of the first greedy token that differs from the reference's (a "
        f"generation that never differs counts with its length); **rep. {n}-gram**: share of generated "
        f"{n}-grams seen earlier in the same generation.",
        "- **accept / mean len**: MTP speculative decoding, draft and target under the scheme: vLLM's "
        "avg draft acceptance rate and mean acceptance length (1 + accepted / drafts).",
        "- **fp32 (noise floor)**: the whole model in fp32 (every matmul, both BMMs) against the bf16 "
        "reference: the rounding noise any bf16 deployment already accepts. A scheme whose figures sit "
        "at this level costs nothing measurable. (The floor changes every matmul, a scheme only its two "
        "BMMs, so the floor can exceed a good scheme on end-to-end figures.)",
        "",
    ]


def _arithmetic(r: dict[str, Any]) -> list[str]:
    """Each scheme's arithmetic (absent when no variant names its schemes: a live server's)."""
    seen: dict[str, str] = {}
    for _, v in r.rows:
        seen.update(v["schemes"])
    if not seen:
        return []
    return ["## Each scheme's arithmetic", "", *(f"- `{name}`: {desc}" for name, desc in seen.items()), ""]


def _theory(r: dict[str, Any]) -> list[str]:
    """Per-op error against theory (absent without operands: they need the weights)."""
    if not r["operands"]:
        return []
    lines = [
        "## Per-op error against theory",
        "",
        "Gaussian theory (formats.md): one MXFP4 quantization (EVEN rule) 11.19 %, MXFP8 2.65 %, FP8 "
        "e4m3 per-tensor 2.65 % / per 1x128 group 2.57 %; a BMM whose weights AND activations are "
        "quantized adds the two in quadrature (W4A4 MXFP4 ≈ 15.8 %, W8A8 FP8 ≈ 3.7 %; bf16 output "
        "rounding adds 0.17 %). That figure assumes the K products of a dot product have random signs. "
        "In a trained layer activations line up with the weights, so the exact output is larger than "
        "that random walk by a factor sqrt(gain) while the quantization errors stay incoherent: the "
        "expected per-op error is the operands' theory / sqrt(gain) (plus the output rounding), gain = "
        "|x·w|² / Σ x²w², measured per layer. Measured on the first window's reference activations "
        "against the exact product:",
        "",
    ]
    head = ["scheme", "W_UK / W_UV err (theory)", "act err (theory)", "BMM #1 err", "BMM #2 err"]
    head += ["Gaussian theory", "aligned theory #1 / #2"]
    body = []
    flags = []
    for label, v in r.rows:
        if "bmm_rel_err" not in v:
            continue
        th = (
            r["theory"].get(next(iter(v["schemes"])).removesuffix("_fnuz"))
            if len(v["schemes"]) == 1
            else None
        )
        w, a, b = v["weight_rel_err"], v["activation_rel_err"], v["bmm_rel_err"]
        al = v.get("theory_bmm_rel_err_aligned")
        acts = [x for x in a.values() if x is not None]
        body.append(
            [
                label,
                f"{_pct(w['w_uk'])} / {_pct(w['w_uv'])} ({_pct(th['weight']) if th else '—'})",
                f"{_pct(max(acts)) if acts else '—'} ({_pct(th['activation']) if th else '—'})",
                _pct(b["q_absorption"]),
                _pct(b["v_up_projection"]),
                _pct(v.get("theory_bmm_rel_err")),
                "—" if al is None else f"{_pct(al['q_absorption'])} / {_pct(al['v_up_projection'])}",
            ]
        )
        flags += _departures(label, v, r["operands"])
    lines += _table(head, body)
    ops = r["operands"]
    gains = ", ".join(f"{k}: {o['gain_uk']:.1f} / {o['gain_uv']:.1f}" for k, o in ops.items())
    kurt = ", ".join(
        f"{k}: {max(o['kurtosis_w_uk'], o['kurtosis_w_uv']):.1f} / "
        f"{max(o['kurtosis_x_uk'], o['kurtosis_x_uv']):.1f}"
        for k, o in ops.items()
    )
    lines += [
        "",
        f"Alignment gain per layer (BMM #1 / #2): {gains}. Excess kurtosis per layer (weights / "
        f"activations; 0 for a Gaussian, larger = heavier tails, which raise block-scaled error): {kurt}.",
        "",
    ]
    if flags:
        lines += [
            "Layers whose per-op error departs from the aligned theory by more than 0.8–1.25x, with the "
            "excess kurtosis of that BMM's activations / weights. Heavy tails raise block-scaled error: a "
            "block's scale is set by its largest element, so its other elements get fewer effective bits "
            "than Gaussian data would; lighter tails work the other way.",
            "",
        ]
        lines += [f"- {f}" for f in flags]
    else:
        lines.append("Every layer's per-op error sits within 0.8–1.25x its alignment-scaled theory.")
    lines += [
        "",
        "The attention output error (per-layer table below) is not the per-op error: BMM #1's error "
        "perturbs the scores, which the softmax may damp or amplify, and BMM #2's error passes through "
        "o_proj, which mixes the heads; it is what the rest of the network sees.",
        "",
    ]
    return lines


def _departures(label: str, v: dict[str, Any], operands: dict[str, dict[str, float]]) -> list[str]:
    """Per layer and BMM: measured per-op error outside 0.8-1.25x of its alignment-scaled theory."""
    out = []
    for o in v.get("ops_by_layer", []):
        for bmm, name in (("uk", "BMM #1"), ("uv", "BMM #2")):
            theory = o[f"theory_{bmm}"]
            if theory is None or theory < 5e-3:  # references: rounding only
                continue
            ratio = o[f"bmm_{bmm}"] / theory
            if not 0.8 <= ratio <= 1.25:
                op = operands[str(o["layer"])]
                out.append(
                    f"{label}, layer {o['layer']} {name}: {_pct(o[f'bmm_{bmm}'])} measured, {_pct(theory)} "
                    f"aligned theory ({ratio:.2f}x); kurtosis {op[f'kurtosis_x_{bmm}']:.1f} / "
                    f"{op[f'kurtosis_w_{bmm}']:.1f}, gain {op[f'gain_{bmm}']:.1f}"
                )
    return out


def _fmt_bucket(x: float | None, kind: str) -> str:
    if x is None:
        return "—"
    return {"pct": f"{100 * x:.2f}", "e": f"{x:.2e}", "f": f"{x:+.4f}"}[kind]


def _by_bucket(r: dict[str, Any]) -> list[str]:
    buckets = [f"{a}–{b - 1}" for a, b in r["buckets"]]
    lines = ["## Drift with context position", ""]
    ref = r["reference"]
    if "nll_by_bucket" in ref:
        lines += [
            "Reference NLL by position (nats; it should fall with position when the model uses its context): "
            + ", ".join(
                f"{b}: {x:.3f}" for b, x in zip(buckets, ref["nll_by_bucket"], strict=True) if x is not None
            ),
            "",
        ]
    for key, title, kind in (
        ("attn_rel_err_by_bucket", "Attention error (%) by position", "pct"),
        ("kl_by_bucket", "KL(reference ‖ scheme) by position (nats)", "e"),
        ("nll_delta_by_bucket", "ΔNLL by position (nats)", "f"),
        ("top1_agreement_by_bucket", "Top-1 agreement (%) by position", "pct"),
    ):
        body = [[label, *(_fmt_bucket(x, kind) for x in v[key])] for label, v in r.rows if key in v]
        if body:  # absent where no variant has it (live servers: no attention error)
            lines += [f"### {title}", "", *_table(["scheme", *buckets], body), ""]
    return lines


def _layers(r: dict[str, Any]) -> list[str]:
    rows_ = [(label, v) for label, v in r.rows if "attn_rel_err_by_layer" in v]
    if not rows_:
        return []
    layers = rows_[0][1]["attn_rel_err_by_layer"]
    head = ["scheme", *(f"{x['layer']}{' (MTP)' if x['mtp'] else ''}" for x in layers)]
    body = [[label, *(_pct(x["rel_err"]) for x in v["attn_rel_err_by_layer"])] for label, v in rows_]
    return ["## Attention error by layer", "", *_table(head, body), ""]


def _decisions(r: dict[str, Any]) -> list[str]:
    ac = r.get("as_configured")
    if not ac:
        return []
    body = [
        [str(d["layer"]), d["module"], d["source"], d["scheme"], d["rule"], d["reason"]]
        for d in ac["decisions"]
    ]
    head = ["layer", "module", "stored", "scheme", "rule", "reason"]
    return ["## As-configured decisions", "", *_table(head, body), ""]


def render_markdown(r: dict[str, Any], plots: list[str]) -> str:
    """The whole report.md: every section, each absent where the report has nothing for it (live servers
    have no weights: no arithmetic, per-op or per-layer figures; the engine has no server notes)."""
    r = r if isinstance(r, Report) else Report.from_json(r)  # every section reads r.rows
    live = r.servers is not None  # the report describes servers, not a checkpoint
    cap, table = caption(r), format_markdown(r)  # the run's caption and the summary table, once
    if live:
        lines = sections.server_header(r, cap) + sections.server_summary(r, table)
    else:
        lines = _header(r, cap) + _summary(r, table)
    lines += tasks.verdict_section(r) + sections.server_notes(r) + sections.decode_section(r)
    lines += sections.mc_kl_section(r)
    lines += _arithmetic(r) + _theory(r) + _layers(r) + _by_bucket(r) + sections.kld_section(r)
    streamed = stream_section(r)  # teacher-forced only: no generation to show
    lines += (streamed or sections.acceptance(r) + sections.generation(r)) + _decisions(r)
    lines += tasks.tasks_section(r) + tasks.flips_section(r)
    if plots:
        lines += ["## Plots", ""] + [f"![{PLOTS.get(p, p)}]({p})" for p in plots] + [""]
    t = r["timings"]
    lines += ["## Timings", "", ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in t.items()), ""]
    return "\n".join(lines)
