"""Engine-level configuration: speculative decoding (vLLM's ``speculative_config`` JSON)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any


class SpeculativeMethod(Enum):
    """Draft methods mlaq implements (vLLM's ``method`` values)."""

    MTP = "mtp"  # the checkpoint's own multi-token-prediction layer(s)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``{"method": "mtp", "num_speculative_tokens": k}``, the JSON vLLM's flag takes.

    >>> SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 3}').num_speculative_tokens
    3
    """

    method: SpeculativeMethod
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string or dict (None stays None: no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - {"method", "num_speculative_tokens"})
        if unknown:
            raise ValueError(
                f"unsupported speculative_config key(s) {unknown}; mlaq takes method and num_speculative_tokens"
            )
        example = '{"method": "mtp", "num_speculative_tokens": 3}'
        if (
            "method" not in value
        ):  # vLLM: "num_speculative_tokens was provided but without speculative model."
            raise ValueError(f'speculative_config needs "method" (vLLM requires it), e.g. {example}')
        if "num_speculative_tokens" not in value:
            raise ValueError(f'speculative_config needs "num_speculative_tokens", e.g. {example}')
        method = value["method"]
        try:
            parsed_method = SpeculativeMethod(method)
        except ValueError:
            choices = [m.value for m in SpeculativeMethod]
            raise ValueError(f"unsupported speculative method {method!r}; mlaq supports {choices}") from None
        return cls(parsed_method, value["num_speculative_tokens"])
