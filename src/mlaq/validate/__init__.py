"""``mlaq validate``: what re-quantizing the absorbed MLA BMMs costs, measured against bf16.

Public API (imported lazily: ``import mlaq.validate`` stays light for the CLI)::

    from mlaq.validate import ValidateConfig, run_validation, write_report
    report = run_validation(ValidateConfig(model=path, eval_text=path / "heldout.txt"))
    report["schemes"]["mxfp4"]["kl"]
    write_report(report, "out/")      # report.md, report.json, PNG plots, written atomically
"""

from __future__ import annotations

from typing import Any

__all__ = ["ValidateConfig", "Variant", "run_validation", "write_report"]

_WHERE = {
    "ValidateConfig": "mlaq.validate.config",
    "Variant": "mlaq.validate.config",
    "run_validation": "mlaq.validate.runner",
    "write_report": "mlaq.validate.report",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'mlaq.validate' has no attribute {name!r}")
