"""mlaq's settings: the ONLY place mlaq reads the environment.

The variables are read once, into a frozen :class:`Settings`, and passed down explicitly; nothing
else in mlaq looks at ``os.environ``. Unlike vLLM's ``value.lower() in ("true", "1")`` (where a typo
silently means False), a value mlaq does not understand is an error.

>>> Settings.from_env({"MLAQ_FP4BMM": "on"})
Settings(fp8bmm=False, fp4bmm=True)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

TRUE_SPELLINGS = ("1", "true", "yes", "on")
FALSE_SPELLINGS = ("0", "false", "no", "off")
ACCEPTED = "1/0, true/false, yes/no, on/off (any case), or empty for the default"


def parse_bool(name: str, value: str | None, default: bool) -> bool:
    """Parse one boolean variable; unset or empty (after stripping blanks) means ``default``."""
    if value is None or not value.strip():
        return default
    v = value.strip().lower()
    if v in TRUE_SPELLINGS:
        return True
    if v in FALSE_SPELLINGS:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean; accepted values: {ACCEPTED}")


def _env_field(env: str, doc: str) -> Any:
    return field(default=False, metadata={"env": env, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Run-time switches. Both BMM flags default OFF: accuracy over speed until opted in."""

    fp8bmm: bool = _env_field(
        "MLAQ_FP8BMM", "re-quantize unquantized kv_b_proj BMM weights to fp8_per_tensor online"
    )
    fp4bmm: bool = _env_field(
        "MLAQ_FP4BMM", "re-quantize bf16/fp16 kv_b_proj BMM weights to mxfp4 online (wins over FP8)"
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every variable from ``environ`` (default: ``os.environ``) once."""
        env = os.environ if environ is None else environ
        values = {
            f.name: parse_bool(f.metadata["env"], env.get(f.metadata["env"]), f.default) for f in fields(cls)
        }
        return cls(**values)

    @staticmethod
    def variable(attr: str) -> str:
        """The environment variable behind a field, e.g. ``variable("fp4bmm") == "MLAQ_FP4BMM"``."""
        for f in fields(Settings):
            if f.name == attr:
                return f.metadata["env"]
        raise KeyError(attr)

    def to_env(self) -> dict[str, str]:
        """``{"MLAQ_FP8BMM": "0", "MLAQ_FP4BMM": "1"}``: how reports show the settings used."""
        return {f.metadata["env"]: "1" if getattr(self, f.name) else "0" for f in fields(self)}

    def to_json(self) -> dict[str, bool]:
        """``{"MLAQ_FP8BMM": false, "MLAQ_FP4BMM": true}``."""
        return {f.metadata["env"]: bool(getattr(self, f.name)) for f in fields(self)}

    def describe(self) -> str:
        """One line: ``MLAQ_FP8BMM=0 MLAQ_FP4BMM=1``."""
        return " ".join(f"{k}={v}" for k, v in self.to_env().items())
