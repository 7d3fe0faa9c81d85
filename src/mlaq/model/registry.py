"""The model types mlaq runs, and what each one's config means when a field is absent.

Every default below is the one transformers 5.x applies for that ``model_type`` (its ``*Config``
class), so a checkpoint that omits a field is read exactly as its reference implementation reads it.
Geometry fields (sizes, ranks, head dims) have no default: :mod:`mlaq.model.config` requires them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ScoringFunc(Enum):
    """How router logits become expert scores."""

    SOFTMAX = "softmax"  # DeepSeek-V2
    SIGMOID = "sigmoid"  # DeepSeek-V3 and later


class TopkMethod(Enum):
    """How the router picks ``num_experts_per_tok`` experts."""

    GREEDY = "greedy"  # plain top-k over all experts
    GROUP_LIMITED_GREEDY = "group_limited_greedy"  # V2: keep the top groups by their best expert
    NOAUX_TC = "noaux_tc"  # V3: choose with e_score_correction_bias, groups by their top-2 sum


class MlpKind(Enum):
    DENSE = "dense"
    SPARSE = "sparse"  # routed + shared experts (MoE)


class IndexerKind(Enum):
    """DeepSeek Sparse Attention, per layer: run the indexer, or reuse the previous full layer's."""

    FULL = "full"
    SHARED = "shared"


@dataclass(frozen=True)
class ArchSpec:
    """One supported ``model_type``: its transformers defaults and fixed layout choices."""

    model_type: str
    description: str
    n_shared_experts: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    n_group: int | None
    topk_group: int | None
    scoring_func: ScoringFunc
    topk_method: TopkMethod
    rms_norm_eps: float
    first_k_dense_replace: int
    sparse_attention: bool = False  # DSA indexer in every attention layer
    indexer_rope_interleave: bool = False  # the indexer's own RoPE layout (V3.2: half-split)
    max_position_embeddings: int = 4096


_DEEPSEEK_V3 = {
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_group": 8,
    "topk_group": 4,
    "scoring_func": ScoringFunc.SIGMOID,
    "topk_method": TopkMethod.NOAUX_TC,
    "rms_norm_eps": 1e-6,
    "first_k_dense_replace": 3,
}

ARCHITECTURES: tuple[ArchSpec, ...] = (
    ArchSpec(
        model_type="deepseek_v2",
        description="DeepSeek-V2 / V2-Lite / V2.5 (softmax router)",
        n_shared_experts=2,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        n_group=None,
        topk_group=None,
        scoring_func=ScoringFunc.SOFTMAX,
        topk_method=TopkMethod.GREEDY,
        rms_norm_eps=1e-6,
        first_k_dense_replace=0,
        max_position_embeddings=2048,
    ),
    ArchSpec(model_type="deepseek_v3", description="DeepSeek-V3 / R1", **_DEEPSEEK_V3),
    ArchSpec(model_type="kimi_k2", description="Kimi-K2 (DeepSeek-V3 architecture)", **_DEEPSEEK_V3),
    ArchSpec(
        model_type="deepseek_v32",
        description="DeepSeek-V3.2 (DeepSeek Sparse Attention)",
        **_DEEPSEEK_V3,
        sparse_attention=True,
        indexer_rope_interleave=False,
        max_position_embeddings=163840,
    ),
    ArchSpec(
        model_type="glm_moe_dsa",
        description="GLM-5 (DeepSeek Sparse Attention with shared indexer layers)",
        **{
            **_DEEPSEEK_V3,
            "n_group": 1,
            "topk_group": 1,
            "rms_norm_eps": 1e-5,
        },
        sparse_attention=True,
        indexer_rope_interleave=True,
        max_position_embeddings=202752,
    ),
    ArchSpec(
        model_type="glm4_moe_lite",
        description="GLM-4.7-Flash",
        **{
            **_DEEPSEEK_V3,
            "routed_scaling_factor": 1.8,
            "n_group": 1,
            "topk_group": 1,
            "rms_norm_eps": 1e-5,
            "first_k_dense_replace": 1,
        },
        max_position_embeddings=202752,
    ),
)


def supported_model_types() -> tuple[str, ...]:
    return tuple(a.model_type for a in ARCHITECTURES)


def get_arch(model_type: str) -> ArchSpec:
    """The spec of ``model_type``; an unsupported one is an error listing the supported ones."""
    for arch in ARCHITECTURES:
        if arch.model_type == model_type:
            return arch
    raise ValueError(
        f"unsupported model_type {model_type!r}; mlaq supports: {', '.join(supported_model_types())}"
    )
