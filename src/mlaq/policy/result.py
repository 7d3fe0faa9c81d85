"""The policy's answer: one :class:`LayerDecision` per MLA layer, gathered in a :class:`PolicyResult`.

The model loader applies ``result.for_layer(i)`` to layer ``i``: it builds the BMM scheme
``decision.scheme``; when ``decision.uses_checkpoint_data`` it hands the checkpoint's stored codes
and scales to the scheme's ``prepare_quantized`` (fp8_per_block: ``mlaq.bmm.split_kv_b_proj_fp8``;
``decision.stored.block_size`` says the block; fp8_per_tensor / fp8_per_channel:
``mlaq.bmm.split_kv_b_proj_fp8_scaled``), otherwise it dequantizes the stored weight exactly and lets
the scheme's ``prepare`` quantize it. W_UK runs as ``decision.scheme_uk``, W_UV^T as ``decision.scheme``;
they differ only for a per-channel FP8 checkpoint (its scales vary along W_UK's K: fp8_per_block runs
them). MXFP4 exception: a checkpoint's MX blocks run along kv_lora_rank, which is K only for W_UV^T;
W_UK is dequantized (exact) and prepared (see ``stored``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mlaq.policy.checkpoint import CheckpointQuant
from mlaq.policy.explicit import ExplicitConfig
from mlaq.policy.model_config import MlaModel, layer_ranges
from mlaq.policy.stored import UNQUANTIZED, StoredFormat, fnuz_variant
from mlaq.settings import Engine, Settings

LOGGER_NAME = "mlaq.policy"


class Rule(str, Enum):
    """Which step of the decision procedure chose a layer's scheme."""

    TARGETS = "targets"  # an explicit --quantization-config targets pattern
    IGNORE = "ignore"  # an explicit --quantization-config ignore pattern
    CHECKPOINT = "checkpoint"  # the checkpoint stores kv_b_proj quantized: its own format runs
    FLAG = "flag"  # MLAQ_FP4BMM / MLAQ_FP8BMM re-quantize an unquantized weight
    GUARD = "guard"  # a flag is on, but the checkpoint's config keeps kv_b_proj unquantized on purpose
    FAMILY_OPT_IN = "family-opt-in"  # ... except Quark MXFP4 DeepSeek-V3-family checkpoints
    PLATFORM = "platform"  # a flag is on, but names a kernel the --platform lacks
    DEFAULT = "default"  # nothing applies: the checkpoint's precision

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LayerDecision:
    """The scheme one layer's kv_b_proj BMMs get, and why."""

    layer: int
    module: str
    source: str  # the checkpoint's stored precision: "bf16", "fp8_per_block", "mxfp4", ...
    scheme: str  # an mlaq.bmm scheme name
    rule: Rule
    reason: str  # one sentence for users
    mtp: bool  # a multi-token-prediction layer (index >= num_hidden_layers)
    stored: StoredFormat  # full stored format (block size, scale format) for the loader
    pattern: str | None = None  # the --quantization-config pattern that decided it (targets/ignore)
    online: str | None = None  # vLLM 0.32 only: the online format of the kv_b_proj linear the BMMs read
    engine_uk: str | None = None  # an engine's W_UK scheme where its two BMMs run different kernels

    @property
    def uses_checkpoint_data(self) -> bool:
        """True when the scheme runs on the checkpoint's own stored format (no online re-quantization):
        the stored scheme itself, or for stored e4m3fn FP8 its ``_fnuz`` variant (:attr:`converts_to_fnuz`)."""
        stored = self.stored.scheme
        return self.stored.quantized and self.scheme in (stored, fnuz_variant(stored))

    @property
    def converts_to_fnuz(self) -> bool:
        """Stored e4m3fn FP8 run as an e4m3fnuz scheme (AMD gfx942): converted exactly as vLLM's
        normalize_e4m3fn_to_e4m3fnuz (same bytes, 0x80 -> 0, scales doubled), not re-quantized."""
        return self.uses_checkpoint_data and self.scheme != self.stored.scheme

    @property
    def scheme_uk(self) -> str:
        """The scheme of W_UK (q absorption): ``scheme`` except where the stored scales vary along W_UK's
        reduction axis (per-channel FP8 used as stored), which only fp8_per_block runs exactly."""
        if self.engine_uk is not None:
            return self.engine_uk
        stored_uk = self.stored.scheme_uk if self.uses_checkpoint_data else None
        if stored_uk and self.converts_to_fnuz:
            return fnuz_variant(stored_uk) or stored_uk
        return stored_uk or self.scheme

    @property
    def requantized(self) -> bool:
        """True when the weight is quantized online to a format the checkpoint does not store."""
        if self.online is not None:  # vLLM 0.32: the BMMs read an online-quantized kv_b_proj weight
            return True
        return self.scheme not in UNQUANTIZED and not self.uses_checkpoint_data

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "module": self.module,
            "source": self.source,
            "scheme": self.scheme,
            "rule": self.rule.value,
            "reason": self.reason,
        }


def _cause(d: LayerDecision, settings: Settings) -> str:
    if d.rule is Rule.TARGETS and (d.online is None or d.scheme in UNQUANTIZED):
        tail = f" as an online {d.online} linear, dequantized for the BMMs" if d.online else ""
        return f"from targets: {d.pattern}{tail}"
    fp4 = d.scheme.startswith("mxfp4")
    if settings.engine is Engine.SGLANG_0523:
        return f"SGLang 0.5.23 defaults, rule {d.rule}"
    if settings.engine is Engine.VLLM_032:
        var = "VLLM_ROCM_USE_AITER_FP4BMM" if fp4 else "VLLM_ROCM_USE_AITER_FP8BMM"
        via = f" on the online {d.online} weight of targets {d.pattern}" if d.online else ""
        return f"VLLM_ROCM_USE_AITER=1, {var}=1 (vLLM 0.32 default){via}"
    var = "MLAQ_FP4BMM" if fp4 else "MLAQ_FP8BMM"
    return f"{var}=1; rule {d.rule}"


@dataclass(frozen=True)
class PolicyResult:
    """Every MLA layer's decision, with what it was decided from."""

    model: MlaModel
    checkpoint: CheckpointQuant
    settings: Settings
    explicit: ExplicitConfig | None
    layers: tuple[LayerDecision, ...]

    @property
    def model_type(self) -> str:
        return self.model.model_type

    def for_layer(self, layer: int) -> LayerDecision:
        if not 0 <= layer < len(self.layers):
            raise ValueError(f"layer {layer} is not an MLA layer of this model (0..{len(self.layers) - 1})")
        return self.layers[layer]

    def settings_json(self) -> dict[str, Any]:
        explicit = None if self.explicit is None else self.explicit.to_json()
        return {**self.settings.to_json(), "quantization_config": explicit}

    def to_json(self) -> dict[str, Any]:
        """``{"model_type", "settings", "layers": [...]}`` — what ``mlaq explain --json`` prints."""
        return {
            "model_type": self.model_type,
            "settings": self.settings_json(),
            "layers": [d.to_json() for d in self.layers],
        }

    def summary(self) -> tuple[int, str]:
        """(logging level, message): ONE warning when any layer is re-quantized, else one info line."""
        n = len(self.layers)
        req = [d for d in self.layers if d.requantized]
        kept = Counter((d.scheme, d.rule.value) for d in self.layers if not d.requantized)
        kept_text = ", ".join(f"{c} {s} (rule {r})" for (s, r), c in kept.most_common())
        if not req:
            return logging.INFO, f"kv_b_proj re-quantized in none of {n} MLA layers: {kept_text}."
        groups = Counter((d.scheme, _cause(d, self.settings)) for d in req)
        if len(groups) == 1:
            (scheme, cause), _ = groups.popitem()
            head = f"Re-quantizing kv_b_proj in {len(req)} of {n} MLA layers to {scheme} ({cause})"
        else:
            parts = ", ".join(f"{c} to {s} ({cause})" for (s, cause), c in groups.most_common())
            head = f"Re-quantizing kv_b_proj in {len(req)} of {n} MLA layers: {parts}"
        rest = f"; unchanged: {kept_text}" if kept else ""
        return logging.WARNING, f"{head}{rest}. `mlaq explain MODEL` shows every layer and why."

    def log(self, logger: logging.Logger | None = None) -> None:
        level, message = self.summary()
        (logger or logging.getLogger(LOGGER_NAME)).log(level, message)


def require_platform(defaults: str, engine: str, settings: Settings, engine_env: object | None) -> None:
    """``--engine-defaults {defaults}`` decides by the GPU: the platform (and its environment) must be known."""
    if settings.platform is None or engine_env is None:
        raise ValueError(
            f"--engine-defaults {defaults} needs --platform (rocm-gfx942, rocm-gfx950, cuda or cpu): what "
            f"{engine} runs depends on the GPU"
        )


def every_layer(
    model: MlaModel,
    checkpoint: CheckpointQuant,
    settings: Settings,
    explicit: ExplicitConfig | None,
    layer: Callable[[int], LayerDecision],
) -> PolicyResult:
    """The result of deciding each MLA layer with ``layer(i)`` (an engine's rules)."""
    layers = tuple(layer(i) for i in model.layer_indices)
    if not layers:
        raise ValueError(f"no MLA layers in {layer_ranges(model.layer_indices)}")
    return PolicyResult(model, checkpoint, settings, explicit, layers)
