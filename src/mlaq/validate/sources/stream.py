"""A layer-streamed checkpoint as a measurement source (``mlaq validate CHECKPOINT --stream``).

The checkpoint is read one layer (and one routed expert) at a time within a memory budget
(mlaq.validate.stream); the record holds the same teacher-forced measurements as the engine source —
per-layer attention error, KL / top-1 / ΔNLL by position, per-op BMM error, the attention flip rate, the
task suite's answers scored teacher-forced (exact match and log-probability) — and no free generation
(it would need every layer for every generated token): ``config["stream"]`` says so, and carries the
plan, the peak resident set, and the bytes read and seconds spent per layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlaq.validate.config import NOISE_FLOOR, REFERENCE, ValidateConfig, Variant, VariantKind
from mlaq.validate.inputs import eval_text_info
from mlaq.validate.progress import Progress
from mlaq.validate.record import OpRecord, Record, TaskScoreRecord, VariantRecord
from mlaq.validate.sources import common
from mlaq.validate.stream.budget import StreamConfig
from mlaq.validate.stream.runner import StreamMeasurement, measure_stream
from mlaq.validate.stream.streams import Stream

NO_GENERATION = (
    "not run: --stream measures teacher-forced only (free generation and MTP acceptance would need "
    "every layer for every generated token); run without --stream on a model that fits for them"
)


class StreamSource:
    """Measures every variant of ``config`` layer-major within ``stream``'s memory budget."""

    name = "stream"

    def __init__(
        self,
        config: ValidateConfig,
        stream: StreamConfig,
        *,
        reference: Variant = REFERENCE,
        noise_floor: Variant | None = NOISE_FLOOR,
    ) -> None:
        self.config, self.stream, self.reference, self.noise_floor = config, stream, reference, noise_floor

    def measure(self, progress: Progress | None = None) -> Record:
        """Each of ``progress``'s steps is a layer's stage, with the bytes read and the peak RSS."""
        m = measure_stream(
            self.config,
            self.stream,
            reference=self.reference,
            noise_floor=self.noise_floor,
            progress=progress,
        )
        return to_record(m)


def _variant(s: Stream, m: StreamMeasurement) -> VariantRecord:
    v = s.variant
    tasks = []
    if m.tasks is not None and v in m.tasks.scores:  # the suite runs the reference and candidates
        tasks = [TaskScoreRecord(x.correct, x.logprob, x.token_accuracy) for x in m.tasks.results(v)]
    return VariantRecord(
        **common.variant_fields(v, s.descriptions, s.sums, s.layers),
        ops=[
            OpRecord(o.layer, o.weight_uk, o.weight_uv, o.act_uk, o.act_uv, o.bmm_uk, o.bmm_uv) for o in s.ops
        ],
        generation=None,
        decisions=m.decisions if v.kind is VariantKind.AS_CONFIGURED else [],
        seconds=s.seconds,
        tasks=tasks,
    )


def stream_info(m: StreamMeasurement) -> dict[str, Any]:
    """What the report says about the streamed run itself."""
    return {
        "generation": NO_GENERATION,
        "memory_budget_bytes": m.plan.budget,
        "peak_rss_bytes": m.peak_rss,
        "within_budget": m.peak_rss <= m.plan.budget,
        "plan": m.plan.to_json(),
        "bytes_read": m.bytes_read,
        "layers": [dataclasses.asdict(s) for s in m.layer_stats],
    }


def to_record(m: StreamMeasurement) -> Record:
    streams = m.streams
    ref = streams[0]
    floor = streams[1] if m.noise_floor else None
    candidates = streams[2:] if m.noise_floor else streams[1:]
    config = common.config_info(m.config, m.data, m.buckets.count)
    config.update({"prompts": 0, "max_tokens": 0, "num_speculative_tokens": 0, "stream": stream_info(m)})
    return Record(
        model=common.model_info(m.config, m.source.config, m.source.num_mtp_layers),
        eval_text=eval_text_info(m.data, ""),
        config=config,
        seed=m.config.shape.seed,
        versions=common.versions(),
        buckets=[list(r) for r in m.buckets.ranges()],
        reference=_variant(ref, m),
        noise_floor=None if floor is None else _variant(floor, m),
        candidates=[_variant(s, m) for s in candidates],
        operands={str(k): v for k, v in sorted(m.operands.items())},
        timings=dict(m.timings),
        source=StreamSource.name,
        tasks=None if m.drawn is None else m.drawn.record(m.timings.get("tasks", 0.0)),
    )
