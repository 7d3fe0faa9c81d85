"""A checkpoint's own quantization, as far as kv_b_proj is concerned.

Each quantization method (fp8, quark, compressed-tensors, modelopt) is one small class that
answers, for a kv_b_proj module name: how is it stored, and does the config leave it unquantized
(excluded, ignored, or simply not targeted)? That last bit is what the guard looks at.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.policy import stored as st
from mlaq.policy.patterns import Pattern, first_covering
from mlaq.policy.stored import StoredFormat

KNOWN_METHODS = ("fp8", "quark", "compressed-tensors", "modelopt")


@dataclass(frozen=True)
class KvBStorage:
    """How one kv_b_proj is stored, and why."""

    stored: StoredFormat
    because: str  # why, as a clause: "exclude lists 're:.*self_attn.*'", "global_quant_config applies"
    left_unquantized: bool  # a quantization config exists and leaves this kv_b_proj unquantized


class CheckpointQuant(ABC):
    """The parsed quantization config of a checkpoint."""

    method: str

    @property
    def has_config(self) -> bool:
        return True

    @abstractmethod
    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        """Storage of the kv_b_proj called ``module``; ``dtype`` is the model's unquantized dtype."""

    @abstractmethod
    def describe(self) -> str:
        """One line for reports: method and its main parameters."""

    def family_opt_in(self, model_type: str) -> bool:
        """Does this checkpoint ask for its excluded attention to be re-quantized? (Quark only.)"""
        return False

    def _excluded(
        self, module: str, dtype: str, patterns: tuple[Pattern, ...], key: str
    ) -> KvBStorage | None:
        hit = first_covering(patterns, module)
        if hit is None:
            return None
        return KvBStorage(st.unquantized(dtype), f"{key} lists {hit.text!r}", True)


@dataclass(frozen=True)
class NoQuant(CheckpointQuant):
    """No quantization config: every weight is stored at the model dtype."""

    method: str = "none"

    @property
    def has_config(self) -> bool:
        return False

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        return KvBStorage(st.unquantized(dtype), "the checkpoint has no quantization config", False)

    def describe(self) -> str:
        return "none (no quantization config)"


@dataclass(frozen=True)
class UnknownQuant(CheckpointQuant):
    """A quant_method mlaq cannot read: only explicit targets can decide its layers."""

    method: str

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        return KvBStorage(st.unknown(self.method), f"mlaq cannot read quant_method {self.method!r}", False)

    def describe(self) -> str:
        return f"{self.method} (not understood by mlaq; known: {', '.join(KNOWN_METHODS)})"


def block_size(value: Any, where: str) -> tuple[int, int]:
    """A ``[rows, cols]`` weight block size."""
    ok = isinstance(value, list | tuple) and len(value) == 2
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f"{where} must be two positive integers [rows, cols], got {value!r}")
    return (value[0], value[1])


def mapping(value: Any, where: str) -> Mapping[str, Any]:
    """``value`` as a JSON object (``None`` -> empty)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {value!r}")
    return value


def native_scheme(storage: KvBStorage, schemes: Collection[str]) -> str | None:
    """The registered scheme that runs the stored format as it is (fp16 -> fp32 if no fp16 scheme)."""
    stored = storage.stored
    if stored.name == "fp16" and "fp16" not in schemes:
        return "fp32"
    if stored.scheme_uk is not None and stored.scheme_uk not in schemes:
        return None
    return stored.scheme if stored.scheme in schemes else None
