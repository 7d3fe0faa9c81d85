"""``write_report``: report.md, report.json and the PNG plots into a directory, atomically.

Everything is first written into a fresh temporary directory beside the target; only when every file
is complete are they moved into place with ``os.replace`` (atomic per file on POSIX). A failure while
writing (a plotting error, a full disk) removes the temporary directory and leaves the previous
report untouched. Plots need matplotlib; without it the report says they were skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlaq import outputs
from mlaq.validate.report_md import PLOTS, render_markdown
from mlaq.validate.report_types import Report

REPORT_MD = "report.md"
REPORT_JSON = "report.json"


def report_json(report: Mapping[str, Any]) -> str:
    """The JSON text (strict: NaN and infinities are errors, never written): the one place a report
    becomes JSON (a typed ``Report`` through ``to_json``; a plain JSON object as it is)."""
    obj = report.to_json() if isinstance(report, Report) else report
    return json.dumps(obj, indent=2, allow_nan=False) + "\n"


def prepare_out(out: str | Path, overwrite: bool = False) -> Path:
    """Check (and create) the report directory before anything is measured: ValueError naming --out
    when it is a file, cannot be created (/proc/x, FILE/sub) or is not writable, or holds a report
    file mlaq did not write (``mlaq.outputs``; ``overwrite`` replaces it)."""
    return outputs.prepare_out(out, [REPORT_JSON, REPORT_MD, *PLOTS], overwrite)


def write_report(
    report: Mapping[str, Any], out: str | Path, *, plots: bool = True, overwrite: bool = False
) -> list[Path]:
    """Write the report files into ``out`` (checked and created by ``prepare_out``); returns their paths."""
    out = prepare_out(out, overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=".mlaq-validate-", dir=out))
    try:
        names = []
        if plots:
            try:
                from mlaq.validate.plots import write_plots

                names = write_plots(report, tmp)
            except ImportError:  # matplotlib is optional
                names = []
        (tmp / REPORT_JSON).write_text(report_json(report), encoding="utf-8")
        md = render_markdown(report, names)
        if plots and not names:
            md += "\n(Plots skipped: matplotlib is not installed.)\n"
        (tmp / REPORT_MD).write_text(md, encoding="utf-8")
        files = [*names, REPORT_JSON, REPORT_MD]
        outputs.check_replaceable(out, files, overwrite)  # nothing of the user's appeared meanwhile
        for name in files:
            os.replace(tmp / name, out / name)
        outputs.note_written(out, files)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [out / name for name in files]
