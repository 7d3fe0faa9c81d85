"""mlaq-tiny's config, and the model through transformers (DeepseekV3ForCausalLM + one MTP layer built from
transformers' own decoder layer): the independent implementation scripts/tiny_eval.py evaluates with.
Training uses scripts/tiny_lean.py, which computes the same function faster.

The MTP layer follows DeepSeek-V3 (arXiv 2412.19437, section 2.2) and vLLM's DeepSeekMTP:
    h'_t = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))      # enorm(embedding) FIRST
    h''  = DecoderLayer(h')                                         # MLA + MoE, causal, rope position t
    logits_t = lm_head(shared_head.norm(h''))                       # predicts x_{t+2}
where h_t is the main model's final hidden state AFTER model.norm (vLLM's previous_hidden_states).
embed_tokens and lm_head are the main model's (not stored again for the MTP layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.masking_utils import create_causal_mask
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm


@dataclass(frozen=True)
class TinyGeometry:
    """The knobs of mlaq-tiny; everything else is fixed by DeepSeek-V3's design."""

    vocab_size: int = 6144
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    q_lora_rank: int | None = 192
    kv_lora_rank: int = 128
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    intermediate_size: int = 768
    moe_intermediate_size: int = 256
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_group: int = 4
    topk_group: int = 2
    max_position_embeddings: int = 2048


def yarn_parameters(factor: float, original: int) -> dict:
    """DeepSeek-V3's YaRN (its config.json's rope_scaling) with another factor: beta_fast 32, beta_slow 1,
    mscale = mscale_all_dim = 1 (cos/sin unscaled; softmax scale times (0.1 ln(factor) + 1)^2)."""
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": float(factor),
            "original_max_position_embeddings": int(original), "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip


def build_config(
    g: TinyGeometry, bos_token_id: int, eos_token_id: int, rope_parameters: dict | None = None
) -> DeepseekV3Config:
    """A genuine deepseek_v3 config: first layer dense, the rest MoE, one MTP layer; plain RoPE unless
    rope_parameters (e.g. yarn_parameters) are given."""
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(g, name) % 32:
            raise ValueError(f"{name}={getattr(g, name)} must be a multiple of 32 (MXFP4 block tiling)")
    return DeepseekV3Config(
        vocab_size=g.vocab_size,
        hidden_size=g.hidden_size,
        intermediate_size=g.intermediate_size,
        moe_intermediate_size=g.moe_intermediate_size,
        num_hidden_layers=g.num_hidden_layers,
        num_attention_heads=g.num_attention_heads,
        num_key_value_heads=g.num_attention_heads,
        n_shared_experts=1,
        n_routed_experts=g.n_routed_experts,
        routed_scaling_factor=2.5,
        kv_lora_rank=g.kv_lora_rank,
        q_lora_rank=g.q_lora_rank,
        qk_rope_head_dim=g.qk_rope_head_dim,
        v_head_dim=g.v_head_dim,
        qk_nope_head_dim=g.qk_nope_head_dim,
        n_group=g.n_group,
        topk_group=g.topk_group,
        num_experts_per_tok=g.num_experts_per_tok,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        hidden_act="silu",
        max_position_embeddings=g.max_position_embeddings,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        attention_bias=False,
        num_nextn_predict_layers=1,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        dtype="bfloat16",
    )


class SharedHead(nn.Module):
    """shared_head: only the norm is stored; the head is the main lm_head."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MtpLayer(nn.Module):
    """One DeepSeek-V3 MTP module; its decoder layer is transformers' own (same names, same math)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = SharedHead(config)


class TinyWithMtp(nn.Module):
    """DeepseekV3ForCausalLM + MTP layer, trained jointly (main CE + lambda * next-next CE)."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.lm = DeepseekV3ForCausalLM(config)
        self.mtp = MtpLayer(config)
        self.lm._init_weights(self.mtp)
        for m in self.mtp.modules():
            self.lm._init_weights(m)

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden: (B, S, H) final-normed main states at t; next_ids: (B, S) tokens t+1 -> (B, S, V)."""
        emb = self.lm.model.embed_tokens(next_ids)  # (B, S, H)
        x = self.mtp.eh_proj(torch.cat([self.mtp.enorm(emb), self.mtp.hnorm(hidden)], dim=-1))
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)  # rope position t, as in vLLM
        mask = create_causal_mask(
            config=self.lm.config,
            inputs_embeds=x,
            attention_mask=None,
            past_key_values=None,
            position_ids=pos,
        )
        pe = self.lm.model.rotary_emb(x, pos)
        x = self.mtp.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return self.lm.lm_head(self.mtp.shared_head.norm(x))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens: (B, T+1). Returns (main_logits (B,T,V), mtp_logits (B,T-1,V), main_ce, mtp_ce)."""
        inp = tokens[:, :-1]  # (B, T)
        out = self.lm.model(input_ids=inp)
        hidden = out.last_hidden_state  # (B, T, H), after model.norm
        logits = self.lm.lm_head(hidden)
        main_ce = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        # MTP at position t sees h_t and x_{t+1}, predicts x_{t+2}; t = 0..T-2.
        mlog = self.mtp_logits(hidden[:, :-1], tokens[:, 1:-1])  # (B, T-1, V)
        mtp_ce = F.cross_entropy(mlog.flatten(0, 1).float(), tokens[:, 2:].flatten())
        return logits, mlog, main_ce, mtp_ce


def moe_gates(model: TinyWithMtp) -> list[nn.Module]:
    """Every MoE router (main MoE layers and the MTP layer), in layer order."""
    layers = [*model.lm.model.layers, model.mtp.layer]
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "gate")]
