"""The report's section on a layer-streamed run (``config["stream"]``): memory, reads, time per layer."""

from __future__ import annotations

from typing import Any


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def stream_section(r: dict[str, Any]) -> list[str]:
    """Markdown lines; [] when the run was not streamed."""
    s = r["config"].get("stream")
    if not s:
        return []
    plan = s["plan"]
    verdict = "within" if s["within_budget"] else "**over**"
    lines = [
        "## Layer streaming",
        "",
        f"- **Memory**: budget {_gib(s['memory_budget_bytes'])}; peak resident set {_gib(s['peak_rss_bytes'])} "
        f"({verdict} the budget); planned peak {_gib(plan['estimated_peak_bytes'])} with "
        f"{plan['attention_chunk']} query rows per attention call and {plan['head_chunk']} positions per "
        f"lm_head call; resident before the run {_gib(plan['baseline_bytes'])}",
        f"- **Read**: {s['bytes_read'] / 1e9:.3f} GB of the checkpoint, each layer once and each routed "
        "expert at most once per layer for every stream",
        f"- **Free generation and MTP acceptance**: {s['generation']}",
        "",
    ]
    head = ["layer", "seconds", "GB read", "routed experts read", "GB/s"]
    body = []
    for x in s["layers"]:
        label = "head" if x["layer"] < 0 else str(x["layer"])
        rate = x["bytes_read"] / 1e9 / x["seconds"] if x["seconds"] else 0.0
        body.append(
            [
                label,
                f"{x['seconds']:.2f}",
                f"{x['bytes_read'] / 1e9:.3f}",
                str(x["experts_read"]),
                f"{rate:.2f}",
            ]
        )
    table = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return lines + table + ["| " + " | ".join(b) + " |" for b in body] + [""]
