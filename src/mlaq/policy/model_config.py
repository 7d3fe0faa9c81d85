"""What the policy needs to know about a model, from its config files alone (no weights).

MLA layers are ``0 .. num_hidden_layers-1`` plus the multi-token-prediction (MTP) layers
``num_hidden_layers .. num_hidden_layers+num_nextn_predict_layers-1``; each has one
``self_attn.kv_b_proj`` whose two absorbed BMMs the policy decides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlaq.policy.local_dir import require_local_dir

# config.json dtype spellings -> the short names mlaq reports (vLLM's words).
_DTYPES = MappingProxyType(
    {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
)
_KV_B_KEY = re.compile(r"^(?P<prefix>.+)\.(?P<i>\d+)\.self_attn\.kv_b_proj\.")


def layer_ranges(layers: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(layers)):
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


@dataclass(frozen=True)
class MlaModel:
    """The MLA layer structure of a checkpoint, as its config.json describes it."""

    model_type: str
    num_hidden_layers: int
    num_nextn_predict_layers: int
    q_lora_rank: int | None
    dtype: str  # "bf16" | "fp16" | "fp32": the precision of unquantized weights
    layers_prefix: str = "model.layers"
    architecture: str = ""  # config.json's architectures[0] ("DeepseekV3ForCausalLM"); SGLang's rules read it
    num_attention_heads: int = 0  # 0: not in config.json (the tensor-parallel split needs it)

    @property
    def num_mla_layers(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def layer_indices(self) -> range:
        return range(self.num_mla_layers)

    def is_mtp(self, layer: int) -> bool:
        return layer >= self.num_hidden_layers

    def self_attn(self, layer: int) -> str:
        return f"{self.layers_prefix}.{layer}.self_attn"

    def kv_b_proj(self, layer: int) -> str:
        return f"{self.self_attn(layer)}.kv_b_proj"

    def attn_linears(self, layer: int) -> tuple[str, ...]:
        """The linear children of one layer's self_attn (q_proj alone when there is no q LoRA)."""
        q = ("q_proj",) if self.q_lora_rank is None else ("q_a_proj", "q_b_proj")
        names = (*q, "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        return tuple(f"{self.self_attn(layer)}.{n}" for n in names)

    def known_modules(self) -> tuple[str, ...]:
        """Every module name mlaq knows from the config: the MLA modules and the modules above them."""
        names: list[str] = []
        parts = self.layers_prefix.split(".")
        names += [".".join(parts[: i + 1]) for i in range(len(parts))]
        for layer in self.layer_indices:
            names += [f"{self.layers_prefix}.{layer}", self.self_attn(layer), *self.attn_linears(layer)]
        return tuple(names)


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        value = default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The dict holding the language model's hyper-parameters (``text_config`` in multimodal configs)."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping) and "kv_lora_rank" not in config:
        return nested
    return config


def mla_model(config: Mapping[str, Any], layers_prefix: str = "model.layers") -> MlaModel:
    """Read the MLA structure from a parsed config.json."""
    cfg = text_config(config)
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    if cfg.get("kv_lora_rank") is None:
        raise ValueError(
            f"config.json (model_type {model_type or '?'}) has no kv_lora_rank: not a Multi-head Latent "
            "Attention model; mlaq handles DeepSeek-V2/V3-style MLA checkpoints"
        )
    raw_dtype = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype") or "bfloat16"
    dtype = _DTYPES.get(str(raw_dtype))
    if dtype is None:
        raise ValueError(f"config.json: unsupported dtype {raw_dtype!r}; expected one of {sorted(_DTYPES)}")
    q_lora = cfg.get("q_lora_rank")
    layers = _int(cfg, "num_hidden_layers")
    if layers == 0:
        raise ValueError("config.json: num_hidden_layers must be at least 1")
    return MlaModel(
        model_type=model_type,
        num_hidden_layers=layers,
        num_nextn_predict_layers=_int(cfg, "num_nextn_predict_layers", 0),
        q_lora_rank=None if q_lora is None else _int(cfg, "q_lora_rank"),
        dtype=dtype,
        layers_prefix=layers_prefix,
        architecture=_architecture(config),
        num_attention_heads=_int(cfg, "num_attention_heads", 0),
    )


def _architecture(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    return str(archs[0]) if isinstance(archs, list) and archs else ""


@dataclass(frozen=True)
class CheckpointFiles:
    """The small JSON files of a checkpoint directory the policy reads."""

    path: Path
    config: Mapping[str, Any]
    hf_quant_config: Mapping[str, Any] | None  # ModelOpt's hf_quant_config.json, when present
    layers_prefix: str


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _layers_prefix(index_path: Path) -> str:
    """The decoder-layer prefix used by the weights (``model.layers`` unless the index says otherwise)."""
    if index_path.is_file():
        index = _load_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
        if not isinstance(weight_map, Mapping):
            raise ValueError(
                f"{index_path}: expected a JSON object with a 'weight_map' object (tensor name -> shard file)"
            )
        for key in weight_map:
            m = _KV_B_KEY.match(key)
            if m:
                return m["prefix"]
    return "model.layers"


def read_checkpoint_dir(path: str | Path) -> CheckpointFiles:
    """Read config.json (required), hf_quant_config.json and the safetensors index (optional)."""
    root = require_local_dir(path)
    config_path = root / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{root}: no config.json (mlaq needs the checkpoint's config files)")
    config = _load_json(config_path)
    if not isinstance(config, Mapping):
        raise ValueError(f"{config_path}: expected a JSON object")
    hq_path = root / "hf_quant_config.json"
    hf_quant = _load_json(hq_path) if hq_path.is_file() else None
    prefix = _layers_prefix(root / "model.safetensors.index.json")
    return CheckpointFiles(root, config, hf_quant, prefix)
