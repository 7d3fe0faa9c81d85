"""A random DeepSeek-V3 checkpoint with the bundled mlaq-tiny-4k's geometry, for ``bench/peer.py``.

    python bench/peer_model.py OUT_DIR [--seed 0] [--sharpen 3.0] [--logit-scale 4.0]

Geometry (the trained model's, scripts/train_ctx.py): hidden 256, 4 layers (first dense), 4 heads,
q_lora_rank 128, kv_lora_rank 512, rope 64, nope 128, v 128 (vLLM's CPU MLA backend needs
kv_lora_rank + rope = 576), 8 routed experts top-2 (noaux_tc, 4 groups keep 2) + 1 shared, one MTP
layer, vocab 4096, max_position_embeddings 4096; bf16 tensors in DeepSeek's own names (per-expert
``mlp.experts.{e}.*``, the MTP layer with its own ``embed_tokens`` / ``shared_head.head`` copies),
which both vLLM and mlaq load. No tokenizer: the benchmark feeds token ids.

A random model is nearly flat: top-1 / top-2 logits tie within bf16 noise and greedy tokens of two
correct engines part after a few tokens. ``--sharpen`` multiplies the query up-projection and the
rope part of kv_a_proj_with_mqa (attention scores grow by its square on the rope part), and
``--logit-scale`` the lm_head, so that greedy choices have margins a parity test can read.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

GEOMETRY = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
}

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    **GEOMETRY,
    "qk_head_dim": 192,
    "head_dim": 64,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "use_cache": True,
}


def _layer(prefix: str, moe: bool, g: torch.Generator, sharpen: float) -> dict[str, torch.Tensor]:
    c = GEOMETRY
    h, n, q = c["hidden_size"], c["num_attention_heads"], c["q_lora_rank"]
    lora, r, p, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]

    def w(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g) * inp**-0.5 * scale

    def norm(dim: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(dim, generator=g)

    kv_a = w(lora + r, h)
    kv_a[lora:] *= sharpen  # the rope key: scores' rope part grows by sharpen ** 2 with q below
    t = {
        "input_layernorm.weight": norm(h),
        "post_attention_layernorm.weight": norm(h),
        "self_attn.q_a_proj.weight": w(q, h),
        "self_attn.q_a_layernorm.weight": norm(q),
        "self_attn.q_b_proj.weight": w(n * (p + r), q, sharpen),
        "self_attn.kv_a_proj_with_mqa.weight": kv_a,
        "self_attn.kv_a_layernorm.weight": norm(lora),
        "self_attn.kv_b_proj.weight": w(n * (p + v), lora),
        "self_attn.o_proj.weight": w(h, n * v),
    }
    if not moe:
        inter = c["intermediate_size"]
        t |= {"mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h)}
        t |= {"mlp.down_proj.weight": w(h, inter)}
    else:
        inter, e = c["moe_intermediate_size"], c["n_routed_experts"]
        t["mlp.gate.weight"] = w(e, h)
        t["mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(e, generator=g)
        for name in [f"experts.{i}" for i in range(e)] + ["shared_experts"]:
            width = inter * (c["n_shared_experts"] if name == "shared_experts" else 1)
            t[f"mlp.{name}.gate_proj.weight"] = w(width, h)
            t[f"mlp.{name}.up_proj.weight"] = w(width, h)
            t[f"mlp.{name}.down_proj.weight"] = w(h, width)
    return {prefix + k: x for k, x in t.items()}


def build(out: Path, *, seed: int = 0, sharpen: float = 3.0, logit_scale: float = 4.0) -> Path:
    """Write config.json + model.safetensors (bf16; the router bias fp32, as DeepSeek stores it)."""
    c = GEOMETRY
    g = torch.Generator().manual_seed(seed)
    h, vocab, n = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    embed = torch.randn(vocab, h, generator=g)
    head = torch.randn(vocab, h, generator=g) * h**-0.5 * logit_scale
    t = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(h)}
    for i in range(n + 1):  # layer n: the MTP layer's decoder block
        t |= _layer(f"model.layers.{i}.", i >= c["first_k_dense_replace"], g, sharpen)
    mtp = f"model.layers.{n}."
    for name in ("enorm", "hnorm", "shared_head.norm"):
        t[f"{mtp}{name}.weight"] = torch.ones(h)
    t[f"{mtp}eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * (2 * h) ** -0.5
    t[f"{mtp}embed_tokens.weight"] = embed.clone()  # DeepSeek-V3 stores copies in the MTP layer
    t[f"{mtp}shared_head.head.weight"] = head.clone()
    tensors = {
        k: (x.float() if k.endswith("e_score_correction_bias") else x.to(torch.bfloat16)).contiguous()
        for k, x in t.items()
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**CONFIG, "mlaq_peer_random": {"seed": seed, "sharpen": sharpen, "logit_scale": logit_scale}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sharpen", type=float, default=3.0)
    p.add_argument("--logit-scale", type=float, default=4.0)
    a = p.parse_args()
    build(a.out, seed=a.seed, sharpen=a.sharpen, logit_scale=a.logit_scale)
    print(a.out)


if __name__ == "__main__":
    main()
