"""Engine-level configuration: speculative decoding (vLLM's ``speculative_config`` JSON)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

# vLLM's --dtype names (vllm/config/model.py _STR_DTYPE_TO_TORCH_DTYPE); "auto": the checkpoint's
DTYPE_NAMES: Mapping[str, torch.dtype | None] = {
    "auto": None,
    "half": torch.float16,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float": torch.float32,
    "float32": torch.float32,
}


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``LLM(dtype=...)``: a torch dtype, None, or one of vLLM's names; None means the checkpoint's."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower()]
    raise ValueError(
        f"dtype {dtype!r} is not one of {', '.join(DTYPE_NAMES)} (vLLM's names) or a torch.dtype"
    )


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
