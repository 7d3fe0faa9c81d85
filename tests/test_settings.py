"""Settings: the BMM flags default OFF, accept the documented spellings, and reject anything else."""

import dataclasses

import pytest

from mlaq.settings import Settings, parse_bool

VARS = ("MLAQ_FP8BMM", "MLAQ_FP4BMM")
TRUE = ["1", "true", "True", "TRUE", "yes", "YES", "on", "On", " 1 ", "tRuE"]
FALSE = ["0", "false", "False", "FALSE", "no", "No", "off", "OFF", " off"]
EMPTY = ["", "   "]
REJECTED = ["2", "-1", "y", "n", "t", "f", "enable", "disabled", "1.0", "truee", "none", "null", "0x1"]


def test_defaults_pinned_with_variables_removed(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    s = Settings.from_env()  # reads os.environ
    assert s == Settings(fp8bmm=False, fp4bmm=False)
    assert s.fp8bmm is False and s.fp4bmm is False


def test_dataclass_defaults_are_off():
    assert Settings() == Settings(False, False)
    assert all(f.default is False for f in dataclasses.fields(Settings) if "env" in f.metadata)


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("MLAQ_FP4BMM", "1")
    monkeypatch.delenv("MLAQ_FP8BMM", raising=False)
    assert Settings.from_env() == Settings(fp8bmm=False, fp4bmm=True)


def test_explicit_mapping_ignores_os_environ(monkeypatch):
    monkeypatch.setenv("MLAQ_FP4BMM", "1")
    assert Settings.from_env({}) == Settings()


@pytest.mark.parametrize("var", VARS)
@pytest.mark.parametrize("value", TRUE)
def test_true_spellings(var, value):
    s = Settings.from_env({var: value})
    assert getattr(s, var[5:].lower()) is True
    other = next(v for v in VARS if v != var)
    assert getattr(s, other[5:].lower()) is False


@pytest.mark.parametrize("var", VARS)
@pytest.mark.parametrize("value", FALSE + EMPTY)
def test_false_and_empty_spellings(var, value):
    assert Settings.from_env({var: value}) == Settings()


@pytest.mark.parametrize("var", VARS)
@pytest.mark.parametrize("value", REJECTED)
def test_rejected_spellings_name_variable_value_and_accepted(var, value):
    with pytest.raises(ValueError) as exc:
        Settings.from_env({var: value})
    msg = str(exc.value)
    assert f"{var}={value!r}" in msg
    assert "1/0, true/false, yes/no, on/off" in msg


def test_both_flags():
    assert Settings.from_env({"MLAQ_FP8BMM": "yes", "MLAQ_FP4BMM": "on"}) == Settings(True, True)


def test_frozen():
    s = Settings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.fp4bmm = True  # type: ignore[misc]


def test_views():
    s = Settings(fp8bmm=False, fp4bmm=True)
    assert s.to_json() == {"MLAQ_FP8BMM": False, "MLAQ_FP4BMM": True}
    assert s.to_env() == {"MLAQ_FP8BMM": "0", "MLAQ_FP4BMM": "1"}
    assert s.describe() == "MLAQ_FP8BMM=0 MLAQ_FP4BMM=1"
    assert Settings.variable("fp4bmm") == "MLAQ_FP4BMM"


def test_parse_bool_default_for_unset():
    assert parse_bool("X", None, True) is True
    assert parse_bool("X", "", False) is False
