"""Which kv_b_proj tensors an audit reads: the MLA layers of the config, their names, geometry and formats.

Everything here comes from config.json, the index and the policy's reading of the quantization
config; no weight byte is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.audit.source import RangeCheckpoint
from mlaq.model.loading.weights import CheckpointQuant as LoaderQuant
from mlaq.policy import CheckpointQuant, MlaModel
from mlaq.policy.model_config import layer_ranges, text_config

# stored formats whose bytes the loader decodes (mlaq.model.loading.weights); others: one clear error
READABLE = ("bf16", "fp16", "fp32", "fp8_per_block", "fp8_per_tensor", "fp8_per_channel", "mxfp4")


@dataclass(frozen=True)
class Geometry:
    """kv_b_proj's shape: [N * (P + V), L]."""

    num_heads: int  # N
    qk_nope_head_dim: int  # P
    v_head_dim: int  # V
    kv_lora_rank: int  # L

    @property
    def kv_b_shape(self) -> tuple[int, int]:
        return (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Geometry:
        cfg = text_config(config)
        keys = ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank")
        values = [cfg.get(k) for k in keys]
        for key, value in zip(keys, values, strict=True):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config.json: {key} must be a positive integer, got {value!r}")
        return cls(*values)


def audited_layers(model: MlaModel, ckpt: RangeCheckpoint) -> tuple[tuple[int, ...], str | None]:
    """(layers to audit, a note) — MTP layers a checkpoint does not store at all are skipped, as the
    loader does (transformers drops them); a missing kv_b_proj of any other layer is an error."""
    names = ckpt.weight_map
    mtp = [i for i in model.layer_indices if model.is_mtp(i)]
    stored_mtp = [i for i in mtp if any(k.startswith(f"{model.layers_prefix}.{i}.") for k in names)]
    skip = set(mtp) - set(stored_mtp)
    layers = tuple(i for i in model.layer_indices if i not in skip)
    missing = [i for i in layers if f"{model.kv_b_proj(i)}.weight" not in names]
    if len(missing) == len(layers):
        raise ValueError(
            f"{ckpt.directory}: no {model.layers_prefix}.{{i}}.self_attn.kv_b_proj.weight in the checkpoint; "
            "config.json describes MLA layers but the weights hold none (not a DeepSeek-V3-style MLA checkpoint?)"
        )
    if missing:
        raise ValueError(
            f"{ckpt.directory}: tensor {model.kv_b_proj(missing[0])}.weight is missing from the checkpoint "
            f"(kv_b_proj of layers {layer_ranges(missing)}); the checkpoint is incomplete"
        )
    note = None
    if skip:
        note = (
            f"config.json declares {len(mtp)} MTP layer(s) ({layer_ranges(mtp)}) but the checkpoint stores "
            "none; audited without them"
        )
    return layers, note


def check_readable(model: MlaModel, quant: CheckpointQuant, layers: tuple[int, ...]) -> dict[int, str]:
    """Each layer's stored format name; an error for a format the loader cannot decode."""
    stored = {i: quant.kv_b_proj(model.kv_b_proj(i), model.dtype).stored for i in layers}
    bad = {i: s for i, s in stored.items() if s.name not in READABLE}
    if bad:
        first = next(iter(bad.values()))
        raise ValueError(
            f"kv_b_proj of layers {layer_ranges(bad)} is stored as {first.name} ({first.detail}), a format "
            f"mlaq audit cannot decode; it reads {', '.join(READABLE)}"
        )
    return {i: s.name for i, s in stored.items()}


def loader_quant(quant: CheckpointQuant, config: Mapping[str, Any]) -> LoaderQuant:
    """The loader's reading of the quantization config (which on-disk layouts to accept)."""
    if quant.method == "none":
        return LoaderQuant(None)
    if quant.method == "modelopt":
        # ModelOpt writes FP8 kv_b_proj as compressed-tensors does: e4m3 weight + weight_scale
        return LoaderQuant("compressed-tensors", (128, 128))
    return LoaderQuant.from_hf(config)
