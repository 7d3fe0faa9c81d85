"""Human-readable views of a :class:`PolicyResult`: consecutive identical layers folded into ranges."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from mlaq.bmm import get_scheme, online_linear
from mlaq.policy import platform, vllm_online
from mlaq.policy.result import LayerDecision, PolicyResult, Rule
from mlaq.settings import Engine


@dataclass(frozen=True)
class Row:
    """Layers ``first..last`` that got the same decision (the reason's own layer index as ``{i}``)."""

    first: int
    last: int
    mtp: bool
    source: str
    scheme: str
    rule: str
    reason: str

    @property
    def layers(self) -> str:
        span = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{span} (MTP)" if self.mtp else span


def _generic_reason(d: LayerDecision) -> str:
    """The reason with this layer's own index written ``{i}``, so equal decisions compare equal."""
    return re.sub(rf"layers\.{d.layer}(?=\D|$)", "layers.{i}", d.reason)


def fold(layers: tuple[LayerDecision, ...]) -> list[Row]:
    """Fold consecutive layers with the same source, scheme, rule and reason (MTP layers apart)."""
    spans: list[tuple[int, int, tuple[bool, str, str, str, str]]] = []
    for d in layers:
        key = (d.mtp, d.source, d.scheme, d.rule.value, _generic_reason(d))
        if spans and spans[-1][1] == d.layer - 1 and spans[-1][2] == key:
            spans[-1] = (spans[-1][0], d.layer, key)
        else:
            spans.append((d.layer, d.layer, key))
    by_layer = {d.layer: d for d in layers}
    # a single layer shows its own, concrete reason
    return [Row(a, b, *k[:4], k[4] if a != b else by_layer[a].reason) for a, b, k in spans]


def format_table(rows: list[Row]) -> str:
    header = ("layers", "source", "scheme", "rule", "reason")
    cells = [header] + [(r.layers, r.source, r.scheme, r.rule, r.reason) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(4)) + "  " + c[4] for c in cells)


def quantizing_line(result: PolicyResult) -> str | None:
    """vLLM's load log line for the layers the config's ``targets`` chose (None without targets)."""
    if result.explicit is None or not result.explicit.targets:
        return None
    written = {t.pattern.text: t.written for t in result.explicit.targets}
    entries = [
        (d.module, "targets", d.pattern, v if isinstance(v := written[d.pattern], str) else json.dumps(v))
        for d in result.layers
        if d.rule is Rule.TARGETS and d.pattern is not None
    ]
    return vllm_online.quantizing_line(entries)


def scheme_summary(name: str, width: int = 200) -> str:
    """The scheme's arithmetic, one sentence, cut at a clause boundary near ``width`` characters."""
    text = get_scheme(name).description
    if len(text) <= width:
        return text
    return text[: text.rfind(", ", 0, width)] + ", ..."


def entry_meanings(result: PolicyResult) -> list[str]:
    """One line per targets entry: what it quantizes. Under ``--engine-defaults vllm-0.32`` every entry has
    vLLM's meaning (released vLLM applies it); otherwise ``--quantization online`` decides."""
    cfg = result.explicit
    if cfg is None:
        return []
    released = result.settings.engine is Engine.VLLM_032
    if released:
        meaning = "kv_b_proj linear (vLLM's meaning: prefill and decode, as released vLLM 0.32 runs it)"
    else:
        meaning = cfg.meaning()
    lines = []
    for t in cfg.targets:
        lines.append(f"  targets {t.pattern.text!r} = {json.dumps(t.written)}: {meaning}")
        if (released or cfg.online) and isinstance(t.written, str) and t.written in online_linear.SCHEMES:
            lines.append(f"    {t.written}: {online_linear.describe(t.written)}")
        elif not released and not cfg.online:
            lines.append(f"    {t.scheme}: {scheme_summary(t.scheme)}")
    return lines


def format_explain(result: PolicyResult, model_path: str, weights: str | None = None) -> str:
    """The full ``mlaq explain`` text: header, settings, table, summary; ``weights`` is a header line
    about the weights (read or not)."""
    m = result.model
    mtp = f" + {m.num_nextn_predict_layers} MTP" if m.num_nextn_predict_layers else ""
    explicit = "none" if result.explicit is None else result.explicit.describe()
    lines = [
        f"model:       {model_path} (model_type {m.model_type or '?'}, {m.dtype})",
        f"MLA layers:  {m.num_mla_layers} ({m.num_hidden_layers} decoder{mtp}); module {m.layers_prefix}.{{i}}.self_attn.kv_b_proj",
        f"checkpoint:  {result.checkpoint.describe()}",
        f"settings:    {result.settings.describe()}",
        f"quantization-config: {explicit}",
        *entry_meanings(result),
        f"platform:    {platform.describe(result.settings.platform)}",
    ]
    if weights is not None:
        lines.append(weights)
    if result.settings.engine is Engine.VLLM_032:
        lines.append("engine:      released vLLM 0.32 with its defaults (--engine-defaults vllm-0.32)")
    if result.settings.engine is Engine.SGLANG_0523:
        lines.append(
            "engine:      released SGLang 0.5.23 with its defaults (--engine-defaults sglang-0.5.23)"
        )
    lines += ["", format_table(fold(result.layers)), ""]
    line = quantizing_line(result)
    if line is not None:
        lines.append(line)
    lines.append(result.summary()[1])
    return "\n".join(lines)


def format_comparison(
    engine: PolicyResult,
    mlaq: PolicyResult,
    aiter_on: PolicyResult | str | None,
    vllm: PolicyResult | None = None,
) -> str:
    """What ``--engine-defaults`` adds: the engine with its AITER switch set when it is unset on ROCm,
    vLLM 0.32's decision (for SGLang), and mlaq's own decision on the same platform."""
    sglang = engine.settings.engine is Engine.SGLANG_0523
    name, var = ("SGLang 0.5.23", "SGLANG_USE_AITER") if sglang else ("vLLM 0.32", "VLLM_ROCM_USE_AITER")
    then = "" if sglang else "; the BMM flags then default to 1"
    lines = []
    if isinstance(aiter_on, str):
        lines += ["", f"With {var}=1 (AMD's ROCm recipes set it), {name}: {aiter_on}."]
    elif aiter_on is not None:
        lines += [
            "",
            f"With {var}=1 (AMD's ROCm recipes set it{then}), {name}:",
            format_table(fold(aiter_on.layers)),
            aiter_on.summary()[1],
        ]
    if vllm is not None:
        lines += [
            "",
            f"vLLM 0.32 on {vllm.settings.platform} with its defaults ({vllm.settings.vllm_describe()}):",
            format_table(fold(vllm.layers)),
            vllm.summary()[1],
        ]
    lines += [
        "",
        f"mlaq's own decision on {mlaq.settings.platform} (MLAQ_FP8BMM/MLAQ_FP4BMM off by default, guard on; "
        f"{mlaq.settings.describe()}):",
        format_table(fold(mlaq.layers)),
        mlaq.summary()[1],
    ]
    return "\n".join(lines)
