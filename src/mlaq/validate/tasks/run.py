"""The suite inside a validation: samples drawn before any model work (bad input fails fast), then
scored under every variant through the engine's model pool, into the record's plain types."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from mlaq.model import Precision
from mlaq.validate.config import Variant
from mlaq.validate.progress import Progress
from mlaq.validate.record import TaskSampleRecord, TaskScoreRecord, TaskSuiteRecord
from mlaq.validate.tasks.generators import TaskSample, TooShort, make_sample
from mlaq.validate.tasks.haystack import Haystack
from mlaq.validate.tasks.scoring import batches, score_variants
from mlaq.validate.tasks.spec import TaskConfig, default_lengths
from mlaq.validate.tasks.surface import Encode
from mlaq.validate.text import EvalData
from mlaq.validate.variants import ModelPool


def resolve(cfg: TaskConfig, max_context: int, model: str) -> TaskConfig:
    """``cfg`` with its lengths decided (None: the defaults within the model's context) and checked."""
    if cfg.lengths is None:
        cfg = replace(cfg, lengths=default_lengths(max_context))
    cfg.check_context(max_context, model)
    return cfg


@dataclass(frozen=True)
class Drawn:
    """The suite of a validation, decided and drawn before any model work."""

    suite: TaskConfig  # lengths resolved
    haystack: Haystack
    samples: list[TaskSample]
    skipped: list[str]  # (task, length) cells that do not fit

    def record(self, seconds: float) -> TaskSuiteRecord:
        return suite_record(self.suite, self.haystack, self.samples, self.skipped, seconds)


def draw_suite(cfg: TaskConfig, max_context: int, model: str, text: EvalData, encode: Encode) -> Drawn:
    """Every source's first step: lengths resolved against the model's context, the haystack (the
    evaluation text), the samples drawn (a bad length or a haystack too short fails here)."""
    suite = resolve(cfg, max_context, model)
    haystack = Haystack(str(text.path), text.tokens)
    samples, skipped = draw(suite, haystack, encode, explicit=cfg.lengths is not None)
    return Drawn(suite, haystack, samples, skipped)


def draw(
    cfg: TaskConfig, haystack: Haystack, encode: Encode, *, explicit: bool
) -> tuple[list[TaskSample], list[str]]:
    """The samples, and the (task, length) cells skipped because the length cannot hold the task. With
    ``explicit`` lengths (the user's --lengths) a cell that does not fit is an error instead."""
    samples: list[TaskSample] = []
    skipped: list[str] = []
    for task in cfg.tasks:
        for length in cfg.lengths or ():
            try:
                samples += [
                    make_sample(task, length, i, cfg, haystack, encode) for i in range(cfg.samples_of(task))
                ]
            except TooShort as exc:
                if explicit:
                    raise
                skipped.append(str(exc).replace("--lengths ", "length ", 1))
    if not samples:
        raise ValueError(f"no task fits the model's context: {'; '.join(skipped)}")
    return samples, skipped


def score(
    samples: Sequence[TaskSample],
    cfg: TaskConfig,
    pool: ModelPool,
    variants: Sequence[Variant],
    precision: Precision,
    progress: Progress,
) -> dict[Variant, list[TaskScoreRecord]]:
    """Every sample under every variant, batch by batch. Under ``decode_only`` the haystack's prefill is
    shared by the variants of one loaded model (it does not use the absorbed BMMs)."""

    def prefill_key(v: Variant) -> tuple[int, str | None]:
        shared = precision is Precision.DECODE_ONLY
        return id(pool.model(v)), None if shared else v.scheme

    scores = score_variants(
        samples,
        variants,
        pool.model,
        prefill_key,
        batch_tokens=cfg.batch_tokens,
        on_batch=lambda done, total: progress.step(
            f"long-context tasks: batch {done}/{total} ({len(samples)} samples x {len(variants)} schemes)"
        ),
    )
    return {
        v: [TaskScoreRecord(s.correct, s.logprob, s.token_accuracy) for s in out] for v, out in scores.items()
    }


def steps(drawn: Drawn) -> int:
    """The progress steps of ``score``: one per batch."""
    return len(batches(drawn.samples, drawn.suite.batch_tokens))


def fingerprint(sample: TaskSample) -> str:
    """The first 16 hex digits of the sha256 of the sample's token ids (prompt then answer, little-endian
    int32): two reports hold the same sample when their fingerprints are equal (``mlaq compare``)."""
    ids = np.asarray(sample.ids, dtype="<i4")
    return hashlib.sha256(ids.tobytes()).hexdigest()[:16]


def suite_record(
    cfg: TaskConfig, haystack: Haystack, samples: Sequence[TaskSample], skipped: list[str], seconds: float
) -> TaskSuiteRecord:
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}
    config["skipped"] = list(skipped)
    wrapped = any(s.wrapped for s in samples)
    return TaskSuiteRecord(
        config,
        {"path": haystack.name, "tokens": len(haystack), "wrapped": wrapped},
        [
            TaskSampleRecord(s.task, s.length, s.index, s.depth, len(s.answer), s.wrapped, fingerprint(s))
            for s in samples
        ],
        seconds,
    )
