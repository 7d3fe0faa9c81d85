"""Engine-level configuration with vLLM's names: ``EngineConfig``, speculative decoding (vLLM's
``speculative_config`` JSON), dtypes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from mlaq.engine.kv_cache import KVCacheDtype
from mlaq.policy.vllm_online import no_duplicate_keys

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
                value = json.loads(value, object_pairs_hook=no_duplicate_keys)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not valid JSON: {exc}") from exc
            except ValueError as exc:  # a key written twice
                raise ValueError(f"speculative_config: {exc}") from None
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


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, with vLLM's names."""

    max_model_len: int = 2048
    max_num_seqs: int = 16
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: room for max_num_seqs sequences of max_model_len
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # or "auto" / "fp8_e4m3" / "fp8"
    kv_cache_scale: float = 1.0  # per-tensor fp8 scale (vLLM's default)
    speculative_config: SpeculativeConfig | None = None  # or its dict / JSON text
    seed: int = 0  # seeds the generators of requests without their own seed
    max_position_embeddings: int | None = (
        None  # the model's context, for advice on a prompt that does not fit
    )
    max_num_batched_tokens: int | None = None  # prompt tokens prefilled in one step; None: max_model_len

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", KVCacheDtype.parse(self.kv_cache_dtype))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def num_blocks(self) -> int:
        per_seq = -(-self.max_model_len // self.block_size)
        return self.num_kv_blocks or self.max_num_seqs * per_seq


def too_long_message(n: int, config: EngineConfig) -> str:
    """What can make a prompt of ``n`` tokens fit: a larger max_model_len only up to the model's context."""
    m, limit = config.max_model_len, config.max_position_embeddings
    head = f"prompt of {n} tokens does not fit max_model_len={m}"
    if limit is None:
        return f"{head}; shorten it or raise max_model_len"
    if n <= limit:
        return f"{head}; raise --max-model-len to at least {n} (the model takes up to {limit}) or shorten it"
    return f"{head}; the model's context is {limit} tokens (max_position_embeddings): shorten the prompt"


@dataclass(frozen=True)
class CompilationConfig:
    """What ``compile=True`` takes of vLLM's ``compilation_config`` JSON: ``{"inductor_compile_config":
    {"max_autotune": true}}``. With max_autotune, inductor times its own C++ GEMM micro-kernels against
    oneDNN's for each linear of the compiled pieces and keeps the faster: on the bundled model batch-1
    decode is 40-50 % faster, batch 8 ~5 %, batch 32 the same; every new batch shape compiles ~40 s
    longer (measured on an AMD EPYC Zen 4). Other keys are refused, not ignored.

    >>> CompilationConfig.parse('{"inductor_compile_config": {"max_autotune": true}}').max_autotune
    True
    """

    max_autotune: bool = False

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | CompilationConfig | None) -> CompilationConfig:
        """From a JSON string or dict; None: the defaults."""
        if value is None or isinstance(value, CompilationConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value, object_pairs_hook=no_duplicate_keys)
            except json.JSONDecodeError as exc:
                raise ValueError(f"compilation_config is not valid JSON: {exc}") from exc
            except ValueError as exc:  # a key written twice
                raise ValueError(f"compilation_config: {exc}") from None
        example = '{"inductor_compile_config": {"max_autotune": true}}'
        if not isinstance(value, Mapping):
            raise ValueError(f"compilation_config must be a JSON object such as {example}, got {value!r}")
        unknown = sorted(set(value) - {"inductor_compile_config"})
        inductor = value.get("inductor_compile_config", {})
        if not isinstance(inductor, Mapping):
            raise ValueError(f"compilation_config: inductor_compile_config must be an object, e.g. {example}")
        unknown += [f"inductor_compile_config.{k}" for k in sorted(set(inductor) - {"max_autotune"})]
        if unknown:
            raise ValueError(
                f"unsupported compilation_config key(s) {unknown}; mlaq's compile=True takes only {example}"
            )
        autotune = inductor.get("max_autotune", False)
        if not isinstance(autotune, bool):
            raise ValueError(f"compilation_config: max_autotune must be true or false, got {autotune!r}")
        return cls(max_autotune=autotune)
