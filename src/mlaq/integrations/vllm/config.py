"""The plugin's one setting: ``--additional-config '{"mlaq": {...}}'`` or, for offline ``LLM(...)``
use, the environment variable ``MLAQ_VLLM_PLUGIN`` holding the same JSON object.

    {"mode": "policy"}
    {"mode": "emulate", "targets": {"re:.*kv_b_proj": "mxfp4"}, "precision": "consistent"}

- ``mode``: ``policy`` (mlaq decides vLLM's two AITER BMM flags per layer and logs why) or ``emulate``
  (the absorbed BMMs of the layers ``targets`` selects run mlaq's bit-exact scheme, on any device).
  No setting at all: the plugin does nothing.
- ``targets`` / ``ignore``: ``mlaq explain --quantization-config``'s JSON (patterns on
  ``model.layers.N.self_attn.kv_b_proj``; a scheme for the layer's absorbed BMMs).
- ``quantization``: ``online`` gives ``targets`` vLLM 0.32's meaning (as ``--quantization online
  --quantization-config`` does in vLLM): the kv_b_proj LINEAR is quantized to the vLLM shorthand, emulated
  by mlaq (its dequantized weight, :mod:`mlaq.model.loading.online`), so prefill reads it and vLLM's own
  bf16 BMMs derive W_UK / W_UV from it; emulate mode only.
- ``precision``: ``decode_only`` (default, as vLLM: prefill decompresses with kv_b_proj as loaded),
  ``consistent`` (prefill decompresses with the scheme's dequantized weights) or ``absorbed`` (prefill
  runs the absorbed path with the scheme's two BMMs, activation rounding included, exactly as decode
  does: mlaq's ``--precision absorbed``); the last two in emulate mode only.

Every key is checked; a wrong one is one error naming it, at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from mlaq.bmm import scheme_names
from mlaq.policy import ExplicitConfig, parse_explicit

KEYS = ("mode", "targets", "ignore", "precision", "quantization")


class Mode(str, Enum):
    POLICY = "policy"
    EMULATE = "emulate"

    def __str__(self) -> str:
        return self.value


class Precision(str, Enum):
    DECODE_ONLY = "decode_only"
    CONSISTENT = "consistent"
    ABSORBED = "absorbed"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PluginConfig:
    """A validated plugin setting; ``where`` names its source in messages."""

    mode: Mode
    explicit: ExplicitConfig | None
    precision: Precision
    where: str

    def describe(self) -> str:
        explicit = "" if self.explicit is None else f", quantization-config {self.explicit.describe()}"
        return f"mode {self.mode}, precision {self.precision}{explicit} (from {self.where})"


def _choice(obj: Mapping[str, Any], key: str, enum: type[Enum], default: Enum | None, where: str) -> Any:
    value = obj.get(key, None if default is None else default.value)
    names = [e.value for e in enum]
    if value not in names:
        got = "missing" if value is None else repr(value)
        raise ValueError(f"{where}.{key}: {got}; expected one of {names}")
    return enum(value)


def parse_config(obj: Any, where: str) -> PluginConfig:
    """Validate the plugin's JSON object (already parsed)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f'{where}: expected a JSON object such as {{"mode": "policy"}}, got {obj!r}')
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; the plugin's keys are {list(KEYS)}")
    mode = _choice(obj, "mode", Mode, None, where)
    precision = _choice(obj, "precision", Precision, Precision.DECODE_ONLY, where)
    explicit = None
    if "targets" in obj or "ignore" in obj:
        sub = {k: obj[k] for k in ("targets", "ignore") if k in obj}
        quantization = obj.get("quantization")
        if quantization not in (None, "online"):
            raise ValueError(
                f"{where}.quantization: {quantization!r}; expected 'online' (vLLM's meaning) or no key"
            )
        online = quantization == "online"
        explicit = parse_explicit(sub, scheme_names(), f"{where} (targets / ignore)", online=online)
    if mode is Mode.EMULATE and (explicit is None or not explicit.targets):
        raise ValueError(
            f"{where}: mode emulate needs targets, the layers whose absorbed BMMs run an mlaq scheme, "
            'e.g. {"mode": "emulate", "targets": {"re:.*kv_b_proj": "mxfp4"}}'
        )
    if "quantization" in obj and (explicit is None or mode is not Mode.EMULATE):
        raise ValueError(f"{where}.quantization: online applies targets, in mode emulate only")
    if explicit is not None and explicit.online and precision is not Precision.DECODE_ONLY:
        raise ValueError(
            f"{where}.precision: {precision} chooses prefill's weights under mlaq's meaning (the absorbed BMMs); "
            "with quantization online prefill runs vLLM's online kv_b_proj linear: drop one of the two keys"
        )
    if mode is Mode.POLICY and precision is not Precision.DECODE_ONLY:
        raise ValueError(
            f"{where}.precision: {precision} changes prefill's arithmetic, which only mode emulate does; "
            "in mode policy vLLM's own kernels run (drop the key)"
        )
    return PluginConfig(mode, explicit, precision, where)


def read_config(additional_config: Mapping[str, Any] | None, env_text: str | None) -> PluginConfig | None:
    """The plugin's setting: ``additional_config["mlaq"]`` wins over ``MLAQ_VLLM_PLUGIN``; None: off."""
    if additional_config and "mlaq" in additional_config:
        return parse_config(additional_config["mlaq"], "--additional-config mlaq")
    if env_text is None:
        return None
    try:
        obj = json.loads(env_text)
    except json.JSONDecodeError as exc:
        raise ValueError(f'MLAQ_VLLM_PLUGIN: not valid JSON ({exc}); e.g. \'{{"mode": "policy"}}\'') from None
    return parse_config(obj, "MLAQ_VLLM_PLUGIN")
