"""``ModelConfig``: a checkpoint's config.json, validated, as one frozen object.

Geometry (sizes, ranks, head dims) must be present: a missing one is an error naming the field, as a
silently defaulted rank would build a different model. Behavioural fields (router, norms, layer
pattern) fall back to the transformers default of the checkpoint's ``model_type`` (see registry).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlaq.model.registry import (
    ArchSpec,
    IndexerKind,
    MlpKind,
    ScoringFunc,
    TopkMethod,
    get_arch,
)
from mlaq.policy.local_dir import require_local_dir

_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "q_lora_rank",  # may be null (q_proj instead of the q LoRA), but must be said
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
_REQUIRED_MOE = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
_REQUIRED_DSA = ("index_topk", "index_n_heads", "index_head_dim")


@dataclass(frozen=True)
class MoEConfig:
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    scoring_func: ScoringFunc
    topk_method: TopkMethod
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention: a lightweight indexer keeps the top-``topk`` keys per query."""

    n_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool  # the indexer's RoPE layout (its own; MLA's is in MLAConfig)
    kinds: tuple[IndexerKind, ...]  # one per main layer; MTP layers always run their own (FULL)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int
    mlp_kinds: tuple[MlpKind, ...]  # one per main layer
    moe: MoEConfig | None
    indexer: IndexerConfig | None
    hf: Mapping[str, Any]  # the raw config.json (read-only), for MLA rope params and the policy

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def num_layers_total(self) -> int:
        """Main layers plus MTP layers (stored as layers num_hidden_layers + i)."""
        return self.num_hidden_layers + self.num_nextn_predict_layers

    def mlp_kind(self, layer: int) -> MlpKind:
        if layer < self.num_hidden_layers:
            return self.mlp_kinds[layer]
        # MTP layers are full decoder layers of the MoE part of the model (DeepSeek-V3 §2.2).
        return MlpKind.SPARSE if self.moe is not None else MlpKind.DENSE

    def indexer_kind(self, layer: int) -> IndexerKind | None:
        if self.indexer is None:
            return None
        return self.indexer.kinds[layer] if layer < self.num_hidden_layers else IndexerKind.FULL

    @classmethod
    def from_dict(cls, hf: Mapping[str, Any], source: str = "config.json") -> ModelConfig:
        """Validate a parsed config.json; ``source`` names the file in error messages. Multimodal
        configs that nest the language model under ``text_config`` are read from there."""
        nested = hf.get("text_config")
        if isinstance(nested, Mapping) and "kv_lora_rank" not in hf:
            outer = {k: hf[k] for k in ("quantization_config", "torch_dtype", "dtype") if k in hf}
            hf = {**outer, **nested}
        if "model_type" not in hf:
            raise ValueError(f"{source}: no 'model_type' field; is this a Hugging Face config.json?")
        arch = get_arch(hf["model_type"])
        _require(hf, _REQUIRED, source, arch)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        n_layers = int(hf["num_hidden_layers"])
        mlp_kinds = _mlp_kinds(hf, arch, n_layers, source)
        moe = _moe(hf, arch, source) if MlpKind.SPARSE in mlp_kinds else None
        return cls(
            model_type=arch.model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=int(hf["num_attention_heads"]),
            q_lora_rank=None if hf["q_lora_rank"] is None else int(hf["q_lora_rank"]),
            kv_lora_rank=int(hf["kv_lora_rank"]),
            qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
            qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
            v_head_dim=int(hf["v_head_dim"]),
            rms_norm_eps=float(_get(hf, "rms_norm_eps", arch.rms_norm_eps)),
            attention_bias=bool(hf.get("attention_bias") or False),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings") or False),
            max_position_embeddings=int(_get(hf, "max_position_embeddings", arch.max_position_embeddings)),
            num_nextn_predict_layers=int(hf.get("num_nextn_predict_layers") or 0),
            mlp_kinds=mlp_kinds,
            moe=moe,
            indexer=_indexer(hf, arch, n_layers, source) if arch.sparse_attention else None,
            hf=MappingProxyType(dict(hf)),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``path/config.json`` (``path`` may also be the file itself)."""
        path = Path(path)
        file = path if path.is_file() else require_local_dir(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        try:
            hf = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: not valid JSON ({exc})") from exc
        if not isinstance(hf, dict):
            raise ValueError(f"{file}: expected a JSON object, got {type(hf).__name__}")
        return cls.from_dict(hf, source=str(file))


def _get(hf: Mapping[str, Any], key: str, default: Any) -> Any:
    value = hf.get(key)
    return default if value is None else value


def _require(hf: Mapping[str, Any], keys: tuple[str, ...], source: str, arch: ArchSpec) -> None:
    # q_lora_rank may be null (no q LoRA); every other required field needs a value
    missing = [k for k in keys if k not in hf or (hf[k] is None and k != "q_lora_rank")]
    if missing:
        raise ValueError(
            f"{source}: {arch.model_type} config is missing required field(s) {', '.join(missing)}; "
            "add them from the model's published config.json"
        )


def _mlp_kinds(hf: Mapping[str, Any], arch: ArchSpec, n_layers: int, source: str) -> tuple[MlpKind, ...]:
    if hf.get("mlp_layer_types") is not None:
        types = list(hf["mlp_layer_types"])
        if len(types) != n_layers:
            raise ValueError(
                f"{source}: mlp_layer_types has {len(types)} entries for num_hidden_layers={n_layers}"
            )
        try:
            return tuple(MlpKind(t) for t in types)
        except ValueError as exc:
            raise ValueError(f"{source}: mlp_layer_types: {exc}; expected 'dense' or 'sparse'") from exc
    if hf.get("n_routed_experts") is None:
        return (MlpKind.DENSE,) * n_layers
    first_dense = int(_get(hf, "first_k_dense_replace", arch.first_k_dense_replace))
    freq = int(_get(hf, "moe_layer_freq", 1))
    return tuple(
        MlpKind.SPARSE if i >= first_dense and i % freq == 0 else MlpKind.DENSE for i in range(n_layers)
    )


def _moe(hf: Mapping[str, Any], arch: ArchSpec, source: str) -> MoEConfig:
    _require(hf, _REQUIRED_MOE, source, arch)
    try:
        scoring = ScoringFunc(_get(hf, "scoring_func", arch.scoring_func.value))
        method = TopkMethod(_get(hf, "topk_method", arch.topk_method.value))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from exc
    n_experts = int(hf["n_routed_experts"])
    n_group = int(_get(hf, "n_group", arch.n_group or 1))
    topk_group = int(_get(hf, "topk_group", arch.topk_group or 1))
    if n_experts % n_group or topk_group > n_group:
        raise ValueError(
            f"{source}: n_routed_experts={n_experts}, n_group={n_group}, topk_group={topk_group}: "
            "experts must split evenly into groups and topk_group <= n_group"
        )
    return MoEConfig(
        n_routed_experts=n_experts,
        num_experts_per_tok=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        n_shared_experts=int(_get(hf, "n_shared_experts", arch.n_shared_experts)),
        n_group=n_group,
        topk_group=topk_group,
        scoring_func=scoring,
        topk_method=method,
        norm_topk_prob=bool(_get(hf, "norm_topk_prob", arch.norm_topk_prob)),
        routed_scaling_factor=float(_get(hf, "routed_scaling_factor", arch.routed_scaling_factor)),
    )


def _indexer(hf: Mapping[str, Any], arch: ArchSpec, n_layers: int, source: str) -> IndexerConfig:
    _require(hf, _REQUIRED_DSA, source, arch)
    if hf["q_lora_rank"] is None:
        raise ValueError(
            f"{source}: {arch.model_type} needs q_lora_rank (the DSA indexer reads the q latent)"
        )
    kinds = _indexer_kinds(hf, n_layers, source)
    if kinds[0] is IndexerKind.SHARED:
        raise ValueError(f"{source}: indexer_types[0] is 'shared' but no earlier layer runs an indexer")
    return IndexerConfig(
        n_heads=int(hf["index_n_heads"]),
        head_dim=int(hf["index_head_dim"]),
        topk=int(hf["index_topk"]),
        rope_interleave=bool(_get(hf, "indexer_rope_interleave", arch.indexer_rope_interleave)),
        kinds=kinds,
    )


def _indexer_kinds(hf: Mapping[str, Any], n_layers: int, source: str) -> tuple[IndexerKind, ...]:
    """Per-layer indexer mode, derived as transformers' GlmMoeDsaConfig does."""
    if hf.get("indexer_types") is not None:
        types = list(hf["indexer_types"])
    elif hf.get("index_topk_pattern") is not None:
        pattern = hf["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    else:
        freq = max(int(_get(hf, "index_topk_freq", 1)), 1)
        offset = int(_get(hf, "index_skip_topk_offset", 2))
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if len(types) != n_layers:
        raise ValueError(f"{source}: indexer_types has {len(types)} entries for num_hidden_layers={n_layers}")
    try:
        return tuple(IndexerKind(t) for t in types)
    except ValueError as exc:
        raise ValueError(f"{source}: indexer_types: {exc}; expected 'full' or 'shared'") from exc
