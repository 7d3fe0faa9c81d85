"""The typed, frozen report: report.json unchanged apart from new fields, reading as the JSON object
did, writing refused.

tests/fixtures/validate_record.json is a small engine run's measurement record (mxfp4, MTP, the needle
task) and tests/fixtures/validate_report.json the report.json the untyped report (a plain dict) gave for
it: every key and value there must come back, in the same order; only new keys may be added.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlaq.validate.record import Record
from mlaq.validate.report import report_json
from mlaq.validate.report_types import Report, freeze, thaw
from mlaq.validate.stats import summarize

FIXTURES = Path(__file__).parent / "fixtures"


def _missing(old: Any, new: Any, where: str = "") -> list[str]:
    """Where ``new`` lacks or changes something of ``old`` (new keys allowed; key order kept)."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{where}: {type(new).__name__}, was an object"]
        out = [f"{where}.{k}: gone" for k in old if k not in new]
        order = [k for k in new if k in old]
        if not out and order != list(old):
            out.append(f"{where}: keys reordered")
        for k in old:
            if k in new:
                out += _missing(old[k], new[k], f"{where}.{k}")
        return out
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{where}: list changed"]
        return [
            x for i, (a, b) in enumerate(zip(old, new, strict=True)) for x in _missing(a, b, f"{where}[{i}]")
        ]
    return [] if old == new and type(old) is type(new) else [f"{where}: {old!r} -> {new!r}"]


@pytest.fixture(scope="module")
def report() -> Report:
    record = Record.from_json(json.loads((FIXTURES / "validate_record.json").read_text()))
    return summarize(record)


def test_report_json_is_unchanged_apart_from_new_fields(report) -> None:
    old = json.loads((FIXTURES / "validate_report.json").read_text())
    assert _missing(old, json.loads(report_json(report))) == []


def test_the_comparison_sees_a_changed_value(report) -> None:
    old = json.loads((FIXTURES / "validate_report.json").read_text())
    new = json.loads(report_json(report))
    new["schemes"]["mxfp4"]["kl"] *= 1 + 1e-15
    del new["reference"]["nll"]
    assert [m.split(":")[0] for m in _missing(old, new)] == [".reference.nll", ".schemes.mxfp4.kl"]


def test_the_report_is_typed_frozen_and_reads_as_its_json(report) -> None:
    assert isinstance(report, Report)
    obj = report.to_json()
    assert report == obj and list(report) == list(obj)
    assert report["schemes"]["mxfp4"]["kl"] == obj["schemes"]["mxfp4"]["kl"]
    assert report.get("noise_floor") is report.noise_floor and report.servers is None
    with pytest.raises(TypeError):
        report["schemes"]["mxfp4"]["kl"] = 0.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        report.seed = 1  # type: ignore[misc]
    with pytest.raises(KeyError):
        report["no such field"]
    assert next(label for label, _ in report.variants()).endswith("(reference)")


def test_freeze_and_thaw_round_trip() -> None:
    obj = {"a": [1, {"b": 2.5}], "c": None}
    frozen = freeze(obj)
    assert thaw(frozen) == obj and type(thaw(frozen)["a"][1]) is dict and type(thaw(frozen)["a"]) is list
    assert frozen["a"] == (1, {"b": 2.5})  # a list is a tuple: read-only all the way down
    with pytest.raises(TypeError):
        frozen["a"][1]["b"] = 3
    with pytest.raises(AttributeError):
        frozen["a"].append(3)  # type: ignore[attr-defined]
