"""The measurement record: everything one validation measured, and nothing derived from it.

A *source* (``mlaq.validate.sources``: the in-memory engine today) fills one ``Record``; statistics
(``mlaq.validate.stats``) are pure functions of it, and report.md, report.json, the PNGs and the terminal
table read only what those functions return. The record is plain data — numbers, strings, lists, dicts
— so it round-trips through JSON (``to_json`` / ``from_json``) and needs neither torch nor the model.

Per-position quantities are kept as sums and token counts per (window, position bucket), so a statistic
can pool the windows (today's report) or treat each window as one sample (intervals over windows).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

RECORD_VERSION = 1


@dataclass(frozen=True)
class Totals:
    """Sums of one per-position quantity and their token counts: ``sums[window][bucket]``."""

    sums: list[list[float]]
    counts: list[list[float]]


@dataclass(frozen=True)
class OpRecord:
    """One layer's two absorbed BMMs under a variant, against the exact product (relative RMS errors)."""

    layer: int
    weight_uk: float
    weight_uv: float
    act_uk: float | None  # the scheme's dynamic activation quantization; None: not exposed
    act_uv: float | None
    bmm_uk: float  # BMM #1, q absorption
    bmm_uv: float  # BMM #2, V up-projection


@dataclass(frozen=True)
class SpecCounts:
    """vLLM's speculative-decoding counters (``vllm:spec_decode_*``) summed over every request."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: list[int]


@dataclass(frozen=True)
class GenerationRecord:
    """Free-running greedy generation: the token ids per prompt and, with speculation, the counters."""

    tokens: list[list[int]]
    seconds: float
    spec: SpecCounts | None = None
    sample: str = ""  # the first prompt's completion, decoded


@dataclass(frozen=True)
class LayerRef:
    """A layer whose attention error was measured (``attn_diff2/N`` and ``attn_ref2/N`` in positions)."""

    layer: int
    mtp: bool


@dataclass(frozen=True)
class VariantRecord:
    """Everything measured for one variant (the reference included). A source fills what it can
    measure; what it cannot stays empty (no layers, no ops, no generation) and the report omits it."""

    name: str
    kind: str  # reference | noise_floor | scheme | as_configured
    dtype: str
    schemes: dict[str, str] = field(default_factory=dict)  # scheme name -> its arithmetic
    positions: dict[str, Totals] = field(default_factory=dict)  # kl, top1, nll_delta, nll, attn_*/N
    layers: list[LayerRef] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    generation: GenerationRecord | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)  # as-configured: explain's rows
    seconds: float = 0.0


@dataclass(frozen=True)
class Record:
    """One validation run. ``model``, ``eval_text``, ``config`` and ``versions`` are descriptive dicts
    copied into the report as they are; ``operands`` is keyed by layer index (as text, like JSON)."""

    model: dict[str, Any]
    eval_text: dict[str, Any]
    config: dict[str, Any]
    seed: int
    versions: dict[str, str]
    buckets: list[list[int]]  # [start, end) token positions of each bucket
    reference: VariantRecord
    noise_floor: VariantRecord | None
    candidates: list[VariantRecord]  # report order: schemes, then as-configured
    operands: dict[str, dict[str, float]]
    timings: dict[str, float]
    source: str = "engine"
    record_version: int = RECORD_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Record:
        if obj.get("record_version") != RECORD_VERSION:
            raise ValueError(
                f"measurement record version {obj.get('record_version')!r}; this mlaq reads {RECORD_VERSION}"
            )
        return cls(
            **{
                **obj,
                "reference": _variant(obj["reference"]),
                "noise_floor": None if obj["noise_floor"] is None else _variant(obj["noise_floor"]),
                "candidates": [_variant(v) for v in obj["candidates"]],
            }
        )


def _variant(obj: dict[str, Any]) -> VariantRecord:
    gen = obj.get("generation")
    if gen is not None:
        spec = gen.get("spec")
        gen = GenerationRecord(**{**gen, "spec": None if spec is None else SpecCounts(**spec)})
    return VariantRecord(
        **{
            **obj,
            "positions": {k: Totals(**t) for k, t in obj.get("positions", {}).items()},
            "layers": [LayerRef(**x) for x in obj.get("layers", [])],
            "ops": [OpRecord(**x) for x in obj.get("ops", [])],
            "generation": gen,
        }
    )
