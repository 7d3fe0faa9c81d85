"""Find and parse a checkpoint's quantization config.

Looked up in this order: ``config.json`` ``quantization_config`` (``compression_config`` in old
compressed-tensors exports), the same inside ``text_config`` (multimodal checkpoints), then
``hf_quant_config.json`` beside config.json (ModelOpt). When config.json has a config it wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from mlaq.policy.checkpoint import CheckpointQuant, NoQuant, UnknownQuant, mapping
from mlaq.policy.compressed_tensors import CompressedTensorsQuant
from mlaq.policy.fp8 import Fp8Quant
from mlaq.policy.model_config import CheckpointFiles
from mlaq.policy.modelopt import ModelOptQuant
from mlaq.policy.quark import QuarkQuant

_ALIASES = MappingProxyType(
    {
        "compressed_tensors": "compressed-tensors",
        "modelopt_fp4": "modelopt",
        "modelopt_fp8": "modelopt",
    }
)


def find_quant_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, str]:
    """The quantization config dict inside a config.json, and where it was found."""
    holders: list[tuple[Mapping[str, Any], str]] = [(config, "config.json")]
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        holders.append((nested, "config.json text_config"))
    for holder, where in holders:
        for key in ("quantization_config", "compression_config"):
            if holder.get(key) is not None:
                return mapping(holder[key], f"{where}: {key}"), f"{where}: {key}"
    return None, ""


def parse_quant_config(qc: Mapping[str, Any], where: str) -> CheckpointQuant:
    """Dispatch on ``quant_method``."""
    method = qc.get("quant_method")
    if method is None and "config_groups" in qc:
        method = "compressed-tensors"  # old exports omit quant_method
    if not isinstance(method, str) or not method:
        raise ValueError(f"{where} has no quant_method; cannot tell how the checkpoint is quantized")
    method = _ALIASES.get(method.lower(), method.lower())
    if method == "fp8":
        return Fp8Quant.parse(qc)
    if method == "quark":
        return QuarkQuant.parse(qc)
    if method == "compressed-tensors":
        return CompressedTensorsQuant.parse(qc)
    if method == "modelopt":
        return ModelOptQuant.parse(qc, where)
    return UnknownQuant(method)


def checkpoint_quant(files: CheckpointFiles) -> CheckpointQuant:
    """The checkpoint's quantization as mlaq understands it (``NoQuant`` when there is none)."""
    qc, where = find_quant_config(files.config)
    if qc is not None:
        return parse_quant_config(qc, where)
    if files.hf_quant_config is not None:
        return ModelOptQuant.parse(files.hf_quant_config, "hf_quant_config.json")
    return NoQuant()
