"""Human-readable views of a :class:`PolicyResult`: consecutive identical layers folded into ranges."""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlaq.policy.result import LayerDecision, PolicyResult


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


def format_explain(result: PolicyResult, model_path: str) -> str:
    """The full ``mlaq explain`` text: header, settings, table, summary."""
    m = result.model
    mtp = f" + {m.num_nextn_predict_layers} MTP" if m.num_nextn_predict_layers else ""
    explicit = "none" if result.explicit is None else result.explicit.describe()
    lines = [
        f"model:       {model_path} (model_type {m.model_type or '?'}, {m.dtype})",
        f"MLA layers:  {m.num_mla_layers} ({m.num_hidden_layers} decoder{mtp}); module {m.layers_prefix}.{{i}}.self_attn.kv_b_proj",
        f"checkpoint:  {result.checkpoint.describe()}",
        f"settings:    {result.settings.describe()}",
        f"quantization-config: {explicit}",
        "",
        format_table(fold(result.layers)),
        "",
        result.summary()[1],
    ]
    return "\n".join(lines)
