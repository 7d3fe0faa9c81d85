"""``run``: one validation for every source — measure into a record, then summarize it into the report.

    report = run(source, progress, verdicts)   # the engine, the layer-streamed checkpoint or live servers
    record = measure(config)          # a Record (record.py): plain data, JSON round-trip
    report = summarize(record)        # stats.py: pure functions; what --json prints, report.* render

A source (sources/) is anything with ``measure(progress) -> Record``; ``measure`` and ``run_validation``
default to the in-memory engine (sources/engine.py).
"""

from __future__ import annotations

from mlaq.validate.config import NOISE_FLOOR, REFERENCE, ValidateConfig, Variant
from mlaq.validate.progress import Progress
from mlaq.validate.record import Record
from mlaq.validate.report_types import Report
from mlaq.validate.sources import Source
from mlaq.validate.stats import summarize
from mlaq.validate.verdict import VerdictConfig


def run(source: Source, progress: Progress | None = None, verdicts: VerdictConfig | None = None) -> Report:
    """Measure with ``source`` and summarize: the report (what ``--json`` prints and report.json holds)."""
    from mlaq.validate.progress import NullProgress

    return summarize(source.measure(progress or NullProgress()), verdicts)


def measure(
    config: ValidateConfig,
    *,
    reference: Variant = REFERENCE,
    noise_floor: Variant | None = NOISE_FLOOR,
    progress: Progress | None = None,
    source: Source | None = None,
) -> Record:
    """Every measurement of every variant, as one record (the engine source unless ``source``)."""
    if source is None:
        from mlaq.validate.sources.engine import EngineSource

        source = EngineSource(config, reference=reference, noise_floor=noise_floor)
    from mlaq.validate.progress import NullProgress

    return source.measure(progress or NullProgress())


def run_validation(
    config: ValidateConfig,
    *,
    reference: Variant = REFERENCE,
    noise_floor: Variant | None = NOISE_FLOOR,
    progress: Progress | None = None,
) -> Report:
    """Measure every candidate (and the noise floor) against ``reference``; returns the report dict."""
    return summarize(measure(config, reference=reference, noise_floor=noise_floor, progress=progress))
