"""The one-row-per-scheme summary: as a terminal table (rich if importable) and as Markdown; with the
long-context task suite, one column per task: its accuracy at the longest length."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from mlaq.validate.report_types import Report
from mlaq.validate.topk_kl import logprobs_label

HEADERS = (
    "scheme",
    "attn err",
    "BMM err (theory)",
    "KL (nats)",
    "top-1",
    "ΔNLL (nats)",
    "1st diff",
    "rep. 4-gram",
    "accept",
    "mean len",
)


def _pct(x: float | None, digits: int = 2) -> str:
    return "—" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def variants(report: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(row label, variant dict) in table order: reference, noise floor, schemes, as-configured."""
    if isinstance(report, Report):
        yield from report.rows
        return
    ref = report["reference"]
    yield f"{ref['name']} (reference)", ref
    if report.get("noise_floor"):
        yield f"{report['noise_floor']['name']} (noise floor)", report["noise_floor"]
    yield from report["schemes"].items()
    if report.get("as_configured"):
        yield "as-configured", report["as_configured"]


def row(label: str, v: dict[str, Any]) -> list[str]:
    bmm = v.get("bmm_rel_err")
    bmm_err = "—" if bmm is None else _pct(max(bmm.values()), 1)
    theory = v.get("theory_bmm_rel_err_aligned")
    if bmm is not None and theory is not None:
        bmm_err += f" ({_pct(max(theory.values()), 1)})"
    gen = v.get("generation") or {}
    first = gen.get("first_divergence_mean")
    same = gen.get("identical_generations")
    first_txt = "—" if first is None else f"{first:.1f}" + (f" ({same} same)" if same else "")
    return [
        label,
        _pct(v.get("attn_rel_err")),
        bmm_err,
        _num(v.get("kl"), ".2e"),
        _pct(v.get("top1_agreement"), 1),
        _num(v.get("nll_delta"), "+.4f"),
        first_txt,
        _pct(gen.get("repeated_ngram_share"), 0),
        _pct(v.get("acceptance_rate"), 1),
        _num(v.get("mean_acceptance_length"), ".2f"),
    ]


def task_columns(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(task, its longest length) of the reference's task figures: one summary column each."""
    tasks = report["reference"].get("tasks") or {}
    return [(task, max(by_len, key=int)) for task, by_len in tasks.items() if by_len]


def _task_cell(v: dict[str, Any], task: str, length: str) -> str:
    """Exact-match accuracy; with the token accuracy beside it where they differ (a long answer such as
    copy's segment earns partial credit token by token)."""
    c = ((v.get("tasks") or {}).get(task) or {}).get(length)
    if c is None:
        return "—"
    tok = c.get("token_accuracy")
    exact = f"{100 * c['accuracy']:.0f} %"
    return exact if tok is None or abs(tok - c["accuracy"]) < 0.005 else f"{exact} (tok {100 * tok:.0f} %)"


def _verdict_cells(v: dict[str, Any]) -> list[str]:
    vd = v.get("verdict")
    if not vd:
        return ["—", "—"]
    mde = vd.get("min_detectable_drop")
    return [vd["verdict"], "—" if mde is None else f"{100 * mde:.0f} pts"]


def has_verdicts(report: dict[str, Any]) -> bool:
    return any(v.get("verdict") for _, v in variants(report))


def rows(report: dict[str, Any]) -> list[list[str]]:
    cols = task_columns(report)
    verdicts = has_verdicts(report)
    return [
        row(label, v) + [_task_cell(v, t, n) for t, n in cols] + (_verdict_cells(v) if verdicts else [])
        for label, v in variants(report)
    ]


def headers(report: dict[str, Any]) -> list[str]:
    n = report["config"]["ngram"]
    tasks = [f"{task} @{length}" for task, length in task_columns(report)]
    verdict = ["verdict", "MDE"] if has_verdicts(report) else []
    return [h.replace("4-gram", f"{n}-gram") for h in HEADERS] + tasks + verdict


def reason_lines(report: dict[str, Any]) -> list[str]:
    """One line per judged scheme: its verdict and why (MDE: the smallest accuracy drop the run could
    detect on the tasks it measured; a smaller one may be there unseen)."""
    out = [
        f"{label}: {v['verdict']['verdict']} — {v['verdict'].get('reason') or '; '.join(v['verdict']['reasons'])}"
        for label, v in variants(report)
        if v.get("verdict")
    ]
    if out:
        out.insert(0, "verdict against bf16 (MDE: the smallest accuracy drop this run could detect):")
    return out


def format_markdown(report: dict[str, Any]) -> str:
    head = headers(report)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows(report)]
    return "\n".join(lines)


def format_plain(report: dict[str, Any]) -> str:
    table = [headers(report), *rows(report)]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def caption(report: dict[str, Any]) -> str:
    c, m = report["config"], report["model"]
    k = c["num_speculative_tokens"]
    if m.get("servers") is not None:  # live servers
        ref = m["servers"].get("reference")
        against = f"reference {ref['model']} at {ref['url']}" if ref else "no reference"
        return (
            f"server {m['served_model']} at {m['path']} against {against}, {c['windows']} x "
            f"{c['context_len']}-token windows (KL from {logprobs_label(c['logprobs'])} logprobs), {c['prompts']} prompts x "
            f"{c['max_tokens']} greedy tokens" + (f", MTP k={k}" if k else "") + f", seed {report['seed']}"
        )
    if c.get("stream"):
        return (
            f"{m['path']} ({m['model_type']}, {m['num_hidden_layers']}+{m['num_mtp_layers']} MLA layers), "
            f"{c['windows']} x {c['context_len']}-token windows, layer-streamed (teacher-forced only, no "
            f"free generation), precision {c['precision']}, seed {report['seed']}"
        )
    return (
        f"{m['path']} ({m['model_type']}, {m['num_hidden_layers']}+{m['num_mtp_layers']} MLA layers), "
        f"{c['windows']} x {c['context_len']}-token windows, {c['prompts']} prompts x {c['max_tokens']} "
        f"greedy tokens"
        + (f", MTP k={k}" if k else "")
        + f", precision {c['precision']}"
        + tp_caption(c)
        + f", seed {report['seed']}"
    )


def tp_caption(c: dict[str, Any]) -> str:
    """``, tensor parallel 2 (per-tensor BMM scales per rank's heads)`` at a size above 1, else nothing."""
    tp = c.get("tensor_parallel_size", 1)
    return f", tensor parallel {tp} (BMM scales per rank's shard of the heads)" if tp > 1 else ""


def print_summary(report: dict[str, Any], stream: Any = None, *, use_rich: bool = True) -> None:
    """The table on ``stream`` (default stdout): rich when importable, else aligned text."""
    stream = stream if stream is not None else sys.stdout
    if use_rich:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            use_rich = False
    if not use_rich:
        print(caption(report), file=stream)
        print(format_plain(report), file=stream)
        print("\n".join(reason_lines(report)), file=stream)
        return
    table = Table(title="mlaq validate", caption=caption(report))
    for h in headers(report):
        table.add_column(h, justify="left" if h == "scheme" else "right")
    for r in rows(report):
        table.add_row(*r)
    needed = len(format_plain(report).splitlines()[0]) + 3 * len(headers(report)) + 4
    console = Console(file=stream)
    if console.width < needed:  # a pipe or a narrow terminal: wrap less, rather than truncate cells
        console = Console(file=stream, width=needed)
    console.print(table)
    for line in reason_lines(report):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
