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
    # [draft tokens, accepted tokens] of each prompt, in prompt order (the same prompts for every variant,
    # so variants pair up prompt by prompt); None where only totals are known (a server's /metrics)
    per_request: list[list[int]] | None = None


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
class TaskSampleRecord:
    """One task sample (the same samples for every variant): what it asked, at which length and depth."""

    task: str
    length: int
    index: int
    depth: float  # where the answer's fact sits in the haystack filler (0 start, 1 end)
    answer_tokens: int
    wrapped: bool  # the haystack text repeated to fill this sample
    fingerprint: str = ""  # sha256 of the prompt and answer token ids (16 hex): the same sample, or not


@dataclass(frozen=True)
class TaskScoreRecord:
    """One variant's score on one task sample."""

    correct: bool  # greedy exact match of the answer
    logprob: float  # mean log-probability of the answer tokens, teacher-forced (nats)
    token_accuracy: float


@dataclass(frozen=True)
class TaskSuiteRecord:
    """The long-context task suite: its settings, haystack and samples (scores are per variant)."""

    config: dict[str, Any]
    haystack: dict[str, Any]  # path, tokens, wrapped (any sample repeated the text)
    samples: list[TaskSampleRecord]
    seconds: float = 0.0


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
    # per-position values of the predicted positions 0..T-2 of each window (``per_token[name][window]``):
    # kl, delta_p, top1, nll_delta (and a server's mass_outside): the quantiles of llama.cpp's list need
    # every value, not sums
    per_token: dict[str, list[list[float]]] = field(default_factory=dict)
    tasks: list[TaskScoreRecord] = field(default_factory=list)  # aligned with Record.tasks.samples


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
    tasks: TaskSuiteRecord | None = None  # the long-context task suite, when it ran

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
                "tasks": _suite(obj.get("tasks")),
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
            "tasks": [TaskScoreRecord(**x) for x in obj.get("tasks", [])],
        }
    )


def _suite(obj: dict[str, Any] | None) -> TaskSuiteRecord | None:
    if obj is None:
        return None
    return TaskSuiteRecord(**{**obj, "samples": [TaskSampleRecord(**x) for x in obj["samples"]]})
