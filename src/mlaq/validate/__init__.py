"""``mlaq validate``: what re-quantizing the absorbed MLA BMMs costs, measured against bf16.

Public API (imported lazily: ``import mlaq.validate`` stays light for the CLI)::

    from mlaq.validate import RunShape, ValidateConfig, measure, summarize, write_report
    record = measure(ValidateConfig(model=path, shape=RunShape(eval_text=path / "heldout.txt")))  # a Record
    report = summarize(record)        # pure statistics: a typed, frozen Report
    report["schemes"]["mxfp4"]["kl"]
    write_report(report, "out/")      # report.md, report.json, PNG plots, written atomically

How the package is laid out (each arrow only reads what is on its left)::

    sources/ (engine, stream, server) --measure--> Record (record.py) --stats.summarize--> Report
        (report_types.py; verdicts from verdict.py) --> summary.py (terminal table), report_md.py,
        plots.py, report.py (files; JSON only there, Report.to_json)

A run's shape (``RunShape``, shape.py: text, windows, prompts, tasks) is the same for every source;
each source's config holds it beside its own settings. ``runner.run(source, progress, verdicts)`` is every run: ``summarize(source.measure(progress))``;
``run_validation(config)`` runs the engine. A new source is one module in sources/ that fills a Record;
a new statistic is a function in stats.py; a new table reads the Report.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "Record",
    "RunShape",
    "ValidateConfig",
    "Variant",
    "measure",
    "run_validation",
    "summarize",
    "write_report",
]

_WHERE = {
    "RunShape": "mlaq.validate.shape",
    "ValidateConfig": "mlaq.validate.config",
    "Variant": "mlaq.validate.config",
    "run_validation": "mlaq.validate.runner",
    "measure": "mlaq.validate.runner",
    "summarize": "mlaq.validate.stats",
    "Record": "mlaq.validate.record",
    "write_report": "mlaq.validate.report",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mlaq.validate' has no attribute {name!r}")
