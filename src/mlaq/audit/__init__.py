"""``mlaq audit``: a per-layer risk report of re-quantizing kv_b_proj, reading only kv_b_proj.

Public API::

    from mlaq.audit import audit, suggest_config, write_report
    record = audit("ckpt/", ("fp8_per_tensor", "mxfp4"), Settings.from_env())
    record["ranking"]                 # layer indices, riskiest first
    write_report(record, "out/")      # report.md, report.json, error_by_layer.png

Layering: audit imports formats, bmm, policy and model (the loader's reader and kv_b preparation);
nothing below it imports audit.
"""

from mlaq.audit.report import format_table, report_json, report_md, write_report
from mlaq.audit.run import audit, risk
from mlaq.audit.source import RangeCheckpoint
from mlaq.audit.suggest import parse_error, suggest_config
from mlaq.model.loading.range_reader import RangeReader, TensorSpan

__all__ = [
    "RangeCheckpoint",
    "RangeReader",
    "TensorSpan",
    "audit",
    "format_table",
    "parse_error",
    "report_json",
    "report_md",
    "risk",
    "suggest_config",
    "write_report",
]
