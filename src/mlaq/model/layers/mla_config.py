"""MLA geometry and RoPE settings with DeepSeek's names; ``MLAConfig.from_hf`` reads a config.json dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.model.layers.rope import Rope, RopeLayout, YarnScaling

# transformers' MLA for these model types rotates interleaved pairs unconditionally (no config flag).
_ALWAYS_INTERLEAVED = ("deepseek_v2", "deepseek_v32", "glm_moe_dsa")
_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class MLAConfig:
    """One MLA layer's shape. Letters used in shape comments: H hidden, N heads, P qk_nope_head_dim,
    R qk_rope_head_dim, V v_head_dim, L kv_lora_rank, Q q_lora_rank."""

    hidden_size: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
    rms_norm_eps: float = 1e-6  # the decoder's norms (not used inside MLA)
    # q_a_layernorm / kv_a_layernorm: transformers and DeepSeek's reference hard-code 1e-6 whatever
    # rms_norm_eps says (vLLM passes rms_norm_eps: 1e-5 for GLM, a tiny difference).
    latent_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    rope_layout: RopeLayout = RopeLayout.INTERLEAVED
    attention_bias: bool = False  # bias on q_a_proj, kv_a_proj_with_mqa, o_proj (as transformers)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"MLAConfig.{name} must be a positive int, got {value!r}")
        r = self.qk_rope_head_dim
        if not isinstance(r, int) or r <= 0 or r % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be a positive even int, got {r!r}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0):
            raise ValueError(
                f"MLAConfig.q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}"
            )
        for name in ("rms_norm_eps", "latent_norm_eps", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"MLAConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not isinstance(self.rope_layout, RopeLayout):
            raise ValueError(f"MLAConfig.rope_layout must be a RopeLayout, got {self.rope_layout!r}")

    @property
    def qk_head_dim(self) -> int:
        """P + R: the per-head query/key width of the naive path."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """L + R: one latent-cache entry, [c_kv | k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(P + R), times yarn_get_mscale(factor, mscale_all_dim)^2 under YaRN."""
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        if self.rope_scaling is not None:
            scale *= self.rope_scaling.softmax_scale_factor
        return scale

    @property
    def rope(self) -> Rope:
        return Rope(self.qk_rope_head_dim, self.rope_theta, self.rope_layout, self.rope_scaling)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> MLAConfig:
        """From a Hugging Face config.json dict (legacy ``rope_theta``/``rope_scaling`` or transformers 5
        ``rope_parameters``). Raises ValueError naming a missing or unsupported field."""

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise ValueError(
                    f"config.json has no {key!r}; MLA needs hidden_size, num_attention_heads, kv_lora_rank, "
                    "qk_nope_head_dim, qk_rope_head_dim, v_head_dim (is this a DeepSeek-V2/V3-family model?)"
                )
            return config[key]

        heads = need("num_attention_heads")
        # num_key_value_heads is deliberately not read: MLA decompresses one key/value per attention
        # head from the shared latent, so the field means nothing here (vLLM ignores it too), and
        # transformers' DeepseekV3Config writes its default of 128 whatever the head count.
        partial = config.get("partial_rotary_factor")
        if partial is not None and partial != 1.0:
            raise ValueError(
                f"config.json: partial_rotary_factor={partial} is not supported (MLA ropes all R)"
            )
        theta, yarn = _rope_from_hf(config)
        return cls(
            hidden_size=need("hidden_size"),
            num_heads=heads,
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
            q_lora_rank=config.get("q_lora_rank"),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=yarn,
            rope_layout=_layout_from_hf(config),
            attention_bias=bool(config.get("attention_bias", False)),
        )


def _layout_from_hf(config: Mapping[str, Any]) -> RopeLayout:
    model_type = config.get("model_type", "")
    flag = config.get("rope_interleave")
    if model_type in _ALWAYS_INTERLEAVED:
        if flag is False:
            raise ValueError(
                f"config.json: rope_interleave=false, but {model_type} always applies interleaved RoPE "
                "in its MLA (transformers and vLLM ignore the flag); remove the flag or fix model_type"
            )
        return RopeLayout.INTERLEAVED
    # deepseek_v3 / kimi_k2 / glm4_moe_lite read the flag, default true
    return RopeLayout.INTERLEAVED if flag is None or flag else RopeLayout.HALF_SPLIT


def _rope_from_hf(config: Mapping[str, Any]) -> tuple[float, YarnScaling | None]:
    params = config.get("rope_parameters")
    source = "rope_parameters"
    if params is None:
        params, source = config.get("rope_scaling") or {}, "rope_scaling"
    if not isinstance(params, Mapping) or any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"config.json: {source} must be one flat dict (per-layer RoPE is not supported)")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"config.json: {source} type {rope_type!r} is not supported; supported: {', '.join(_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
    if missing:
        raise ValueError(f"config.json: yarn {source} lacks {', '.join(missing)}")
    yarn = YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_float_or(params.get("mscale"), 1.0),
        mscale_all_dim=_float_or(params.get("mscale_all_dim"), 0.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=params.get("attention_factor"),
    )
    return float(theta), yarn


def _float_or(value: Any, default: float) -> float:
    return default if value is None else float(value)
