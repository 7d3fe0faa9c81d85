"""The audit record as report.json, report.md, a terminal table and a PNG, written all-or-nothing.

Files are written into a temporary directory inside ``--out`` and moved into place only once all of
them exist (``os.replace``), so a failed run never leaves a half-written report over a good one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlaq import outputs
from mlaq.audit.run import risk

REPORT_JSON, REPORT_MD, PLOT_PNG, CONFIG_JSON = (
    "report.json",
    "report.md",
    "error_by_layer.png",
    "quantization-config.json",
)
OUTPUTS = (REPORT_JSON, REPORT_MD, PLOT_PNG, CONFIG_JSON)


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.3g}"


def report_json(r: dict[str, Any]) -> str:
    return json.dumps(r, indent=2, allow_nan=False) + "\n"


def _io_line(r: dict[str, Any]) -> str:
    io = r["io"]
    mib = 2**20
    return (
        f"read {io['bytes_read'] / mib:.1f} MiB: kv_b_proj weights {io['kv_b_weight_bytes'] / mib:.1f} MiB + scales "
        f"{io['scale_bytes'] / mib:.2f} MiB + headers {io['header_bytes'] / mib:.2f} MiB, from {io['files_read']} of "
        f"{io['files_in_checkpoint']} files"
    )


def ranked_rows(r: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the ranked table, riskiest layer first."""
    by_layer = {layer["layer"]: layer for layer in r["layers"]}
    head = ["rank", "layer", "stored", "policy now"]
    for s in r["schemes"]:
        head += [f"{s} W_UK", f"{s} W_UV", f"{s} BMM pred."]
    head += ["amax spread UK/UV", "kurtosis UK/UV"]
    rows = []
    for rank, i in enumerate(r["ranking"], 1):
        layer = by_layer[i]
        pol = layer["policy"]
        row = [
            str(rank),
            f"{i}{' (MTP)' if layer['mtp'] else ''}",
            layer["stored"],
            f"{pol['scheme']} ({pol['rule']})",
        ]
        for s in r["schemes"]:
            e = layer["schemes"][s]
            pred = [e[h]["predicted_bmm"] for h in ("w_uk", "w_uv")]
            row += [_pct(e["w_uk"]["rel_rms"]), _pct(e["w_uv"]["rel_rms"])]
            row += [_pct(max(pred)) if None not in pred else "—"]
        uk, uv = layer["w_uk"], layer["w_uv"]
        row += [f"{_num(uk['head_amax_spread'])} / {_num(uv['head_amax_spread'])}"]
        row += [f"{uk['kurtosis']:.2f} / {uv['kurtosis']:.2f}"]
        rows.append(row)
    return head, rows


def format_table(r: dict[str, Any], limit: int | None = None) -> str:
    """The terminal view: header lines, the ranked table (``limit`` rows), the I/O line."""
    head, rows = ranked_rows(r)
    shown = rows if limit is None else rows[:limit]
    widths = [max(len(c[j]) for c in [head, *shown]) for j in range(len(head))]
    lines = [
        f"checkpoint: {r['checkpoint']} (model_type {r['model_type'] or '?'}; {r['quantization']})",
        f"layers ranked by {r['rank_by']} relative RMS weight error (larger of W_UK, W_UV), riskiest first",
        "",
        *("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [head, *shown]),
    ]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more layers in report.md / report.json")
    lines += ["", f"{_io_line(r)}; {r['seconds']:.1f} s"]
    if r.get("note"):
        lines.append(f"note: {r['note']}")
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def report_md(r: dict[str, Any]) -> str:
    geo = r["geometry"]
    mtp = geo["num_nextn_predict_layers"]
    lines = [
        f"# mlaq audit: {r['checkpoint']}",
        "",
        f"- model_type {r['model_type'] or '?'}: {geo['num_hidden_layers']} decoder layers"
        + (f" + {mtp} MTP" if mtp else "")
        + f", {geo['num_heads']} heads, kv_lora_rank {geo['kv_lora_rank']}, qk_nope_head_dim "
        f"{geo['qk_nope_head_dim']}, v_head_dim {geo['v_head_dim']}",
        f"- checkpoint quantization: {r['quantization']}",
        f"- settings: {json.dumps(r['settings'])}",
        f"- I/O: {_io_line(r)}; {r['seconds']:.1f} s",
        "",
        "Every figure is exact over the whole weight (no sampling; each W_UK / W_UV half has "
        f"{r['layers'][0]['w_uk']['elements']:,} elements). W_UK / W_UV: relative RMS error of the scheme's "
        "weight, as the loader builds it at load (quantized along K, the reduction axis), against the "
        "checkpoint's exact value. BMM pred.: the larger relative output error of the two BMMs predicted for "
        "N(0,1) activations: sqrt(weight error^2 + the scheme's activation error^2 + bf16 output rounding^2) "
        "(Gaussian theory as in `mlaq validate`). amax spread: largest / smallest per-head amax.",
    ]
    if r.get("note"):
        lines += ["", f"Note: {r['note']}"]
    lines += ["", f"## Layers ranked by {r['rank_by']} weight error (riskiest first)", ""]
    lines += _md_table(*ranked_rows(r))
    lines += ["", "## Per-scheme detail", "", *_detail(r)]
    if r.get("suggested_config"):
        sc = r["suggested_config"]
        lines += [
            "",
            "## Suggested --quantization-config",
            "",
            f"{sc['scheme']} on {len(sc['targeted_layers'])} layer(s) whose weight error is at most "
            f"{_pct(sc['max_error'])}; {len(sc['kept_layers'])} layer(s) keep the checkpoint's precision (ignore).",
            "",
            "```json",
            json.dumps(sc["config"], indent=2),
            "```",
        ]
    return "\n".join(lines) + "\n"


def _detail(r: dict[str, Any]) -> list[str]:
    head = [
        "layer",
        "scheme",
        "half",
        "rel RMS",
        "max abs",
        "flushed elems",
        "MX blocks flush / saturate",
        "BMM pred.",
    ]
    rows = []
    for layer in sorted(r["layers"], key=lambda x: -risk(x, r["rank_by"])):
        for s in r["schemes"]:
            for half in ("w_uk", "w_uv"):
                e = layer["schemes"][s][half]
                mx = (
                    "—"
                    if e["mx_flush_blocks"] is None
                    else f"{_pct(e['mx_flush_blocks'], 1)} / {_pct(e['mx_saturate_blocks'], 1)}"
                )
                rows.append(
                    [
                        str(layer["layer"]),
                        s,
                        half.upper(),
                        _pct(e["rel_rms"]),
                        f"{e['max_abs']:.3g}",
                        _pct(e["flushed"], 3),
                        mx,
                        _pct(e["predicted_bmm"]),
                    ]
                )
    return _md_table(head, rows)


def prepare_out(out: str | Path, overwrite: bool = False) -> Path:
    """Check (and create) ``--out`` before the audit reads anything (``mlaq.outputs``): one line when it
    is a file, not writable, or holds a file of these names that mlaq did not write."""
    return outputs.prepare_out(out, OUTPUTS, overwrite)


def write_report(
    r: dict[str, Any], out: str | Path, *, plot: bool = True, overwrite: bool = False
) -> list[Path]:
    """Write report.json, report.md, the PNG and (with a suggestion) quantization-config.json into ``out``."""
    out = prepare_out(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=".mlaq-audit-", dir=out))
    try:
        names = [REPORT_JSON, REPORT_MD]
        (tmp / REPORT_JSON).write_text(report_json(r), encoding="utf-8")
        (tmp / REPORT_MD).write_text(report_md(r), encoding="utf-8")
        if r.get("suggested_config"):
            (tmp / CONFIG_JSON).write_text(json.dumps(r["suggested_config"]["config"], indent=2) + "\n")
            names.append(CONFIG_JSON)
        if plot:
            from mlaq.audit.plots import plot_errors

            plot_errors(r, tmp / PLOT_PNG)
            names.append(PLOT_PNG)
        outputs.check_replaceable(out, names, overwrite)
        for name in names:
            os.replace(tmp / name, out / name)
        outputs.note_written(out, names)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in names]
