"""Layer-level parity with transformers' MLA (the oracle nobody here wrote), float32.

Each case builds a tiny transformers attention layer from a config.json-style dict, copies its weights
into MLAttention by name, and compares outputs over a causal prompt: the naive path in one pass, the
absorbed path in one pass, and prefill + token-by-token (and 3-at-a-time) absorbed decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config, Glm4MoeLiteConfig, GlmMoeDsaConfig
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
from transformers.models.glm4_moe_lite import modeling_glm4_moe_lite as glm_lite
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm_dsa

from mlaq.model.layers.mla import AttnPath, MLAttention
from mlaq.model.layers.mla_config import MLAConfig

YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
BASE = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "max_position_embeddings": 163840,
}
DEEPSEEK = {**BASE, "q_lora_rank": 32, "qk_nope_head_dim": 128, "v_head_dim": 128}
GLM = {**BASE, "q_lora_rank": 48, "qk_nope_head_dim": 192, "v_head_dim": 256}


@dataclass(frozen=True)
class Case:
    config_cls: type
    module: object  # the transformers modeling module
    attn: str
    rotary: str
    config: dict


CASES = {
    "deepseek_v3_yarn": Case(
        DeepseekV3Config, v3, "DeepseekV3Attention", "DeepseekV3RotaryEmbedding",
        {**DEEPSEEK, "model_type": "deepseek_v3", "rope_theta": 10000, "rope_scaling": YARN},
    ),
    "deepseek_v3_half_split_bias": Case(
        DeepseekV3Config, v3, "DeepseekV3Attention", "DeepseekV3RotaryEmbedding",
        {**DEEPSEEK, "model_type": "deepseek_v3", "rope_theta": 10000, "rope_interleave": False,
         "attention_bias": True},
    ),
    "deepseek_v2_no_qlora_mscale": Case(
        DeepseekV2Config, v2, "DeepseekV2Attention", "DeepseekV2RotaryEmbedding",
        {**DEEPSEEK, "model_type": "deepseek_v2", "q_lora_rank": None, "rope_theta": 10000,
         "rope_scaling": {**YARN, "factor": 8, "mscale": 0.9, "mscale_all_dim": 0.6}},
    ),
    "glm4_moe_lite": Case(
        Glm4MoeLiteConfig, glm_lite, "Glm4MoeLiteAttention", "Glm4MoeLiteRotaryEmbedding",
        # rms_norm_eps far from 1e-6: transformers' q_a/kv_a layernorms ignore it, and so must mlaq
        {**GLM, "model_type": "glm4_moe_lite", "rope_theta": 1e6, "rope_scaling": None, "rms_norm_eps": 0.01},
    ),
}  # fmt: skip


def build(case: Case, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, MLAttention]:
    hf_cfg = case.config_cls(**case.config)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    ref = getattr(case.module, case.attn)(hf_cfg, 0).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if "layernorm" in name
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
    rotary = getattr(case.module, case.rotary)(hf_cfg)
    mine = MLAttention(MLAConfig.from_hf(case.config))
    mine.load_state_dict({k: v for k, v in ref.state_dict().items() if not k.startswith("indexer.")})
    mine.prepare("fp32")
    return ref, rotary, mine


def causal_additive(t: int) -> torch.Tensor:
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    return torch.zeros(1, 1, t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)


def reference(case: Case, ref, rotary, hidden, positions, mask, **kw) -> torch.Tensor:
    with torch.no_grad():
        if case.module is v2:
            freqs = rotary(hidden, positions)
            return ref(hidden, attention_mask=mask, position_embeddings=freqs)[0]
        return ref(hidden, position_embeddings=rotary(hidden, positions), attention_mask=mask, **kw)[0]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", list(CASES))
def test_layer_parity_with_transformers(name):
    case = CASES[name]
    ref, rotary, mine = build(case)
    b, t, start = 2, 11, 37  # a prompt that starts at position 37: positions 0..36 hold nothing
    hidden = torch.randn(b, t, 64)
    positions = (torch.arange(t) + start).expand(b, t)
    expected = reference(case, ref, rotary, hidden, positions, causal_additive(t))
    with torch.no_grad():
        for path in (AttnPath.NAIVE, AttnPath.ABSORBED):
            out, _ = mine(hidden, positions, path=path)
            assert rel(out, expected) <= 1e-5, (path, rel(out, expected))
        for step in (1, 3):  # prefill 4 naive, then decode (MTP-style when step > 1) absorbed
            out, entries = mine(hidden[:, :4], positions[:, :4], path=AttnPath.NAIVE)
            outs = [out]
            cache = torch.cat((torch.zeros(b, start, entries.shape[-1]), entries), dim=1)  # by position
            for i in range(4, t, step):
                j = min(i + step, t)
                skip_empty = (torch.arange(start + j) >= start).expand(b, j - i, -1)  # (B, T, K)
                out, entries = mine(
                    hidden[:, i:j], positions[:, i:j], cache, path=AttnPath.ABSORBED, key_mask=skip_empty
                )
                outs.append(out)
                cache = torch.cat((cache, entries), dim=1)
            assert rel(torch.cat(outs, dim=1), expected) <= 1e-5


@pytest.mark.parametrize("path", [AttnPath.NAIVE, AttnPath.ABSORBED])
def test_dsa_key_mask_matches_glm_moe_dsa_topk(path):
    """GLM-5's DSA attention with a given top-k selection (the indexer is the models helper's) equals
    mlaq's attention with the same selection as key_mask."""
    config = {**GLM, "model_type": "glm_moe_dsa",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
              "num_hidden_layers": 1, "indexer_types": ["shared"], "index_topk": 4}  # fmt: skip
    case = Case(GlmMoeDsaConfig, glm_dsa, "GlmMoeDsaAttention", "GlmMoeDsaRotaryEmbedding", config)
    ref, rotary, mine = build(case, seed=3)
    assert ref.indexer is None  # "shared" layer: takes the top-k from outside
    b, t, topk = 2, 9, 4
    hidden = torch.randn(b, t, 64)
    positions = torch.arange(t).expand(b, t)
    gen = torch.Generator().manual_seed(0)
    # per query: itself plus 3 random earlier-or-later positions (later ones are causally masked anyway)
    others = torch.stack([torch.randperm(t, generator=gen)[: topk - 1] for _ in range(b * t)]).view(
        b, t, topk - 1
    )
    topk_idx = torch.cat((positions[..., None], others), dim=-1)  # (B, T, topk)
    expected = reference(case, ref, rotary, hidden, positions, causal_additive(t), prev_topk_indices=topk_idx)
    key_mask = torch.zeros(b, t, t, dtype=torch.bool).scatter(-1, topk_idx, True)
    with torch.no_grad():
        out, _ = mine(hidden, positions, path=path, key_mask=key_mask)
        dense, _ = mine(hidden, positions, path=path)
    assert rel(out, expected) <= 1e-5
    assert rel(dense, expected) > 1e-2  # the selection matters in this setup
