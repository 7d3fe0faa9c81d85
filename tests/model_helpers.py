"""Builders of tiny checkpoints for the model tests.

- ``hf_checkpoint``: a random model of one architecture built and saved by transformers itself (the
  oracle), small dims but the real head geometry (DeepSeek P=128/R=64/V=128, GLM P=192/R=64/V=256).
- ``add_mtp_layer``: adds random MTP tensors (transformers drops them) and re-saves the checkpoint sharded.
(Quantized checkpoints in the real on-disk formats: quant_helpers.py.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_COMMON: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
_DEEPSEEK = {"qk_nope_head_dim": 128, "v_head_dim": 128}
_GLM = {"qk_nope_head_dim": 192, "v_head_dim": 256}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
}
_DSA = {"index_topk": 4, "index_n_heads": 16, "index_head_dim": 96}

# model_type -> (transformers config class, kwargs). kimi_k2 is DeepSeek-V3 with another model_type.
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "deepseek_v2": (
        "DeepseekV2Config",
        {
            **_DEEPSEEK,
            "q_lora_rank": None,
            "n_shared_experts": 2,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        {**_DEEPSEEK, "n_group": 4, "topk_group": 2, "rope_parameters": _YARN},
    ),
    "kimi_k2": ("DeepseekV3Config", {**_DEEPSEEK, "n_group": 1, "topk_group": 1, "rope_parameters": _YARN}),
    "deepseek_v32": ("DeepseekV32Config", {**_DEEPSEEK, **_DSA, "n_group": 2, "topk_group": 1}),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        {**_GLM, **_DSA, "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]},
    ),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", {**_GLM, "routed_scaling_factor": 1.8}),
}


def hf_model(model_type: str, seed: int = 0, **overrides: Any) -> Any:
    """A random transformers model of ``model_type`` (eager attention, fp32, eval mode)."""
    import transformers

    cls_name, kwargs = ARCHS[model_type]
    config = getattr(transformers, cls_name)(**{**_COMMON, **kwargs, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm / LayerNorm weights near 1, biases near 0
                p.copy_(torch.randn_like(p) * 0.1 + (0.0 if name.endswith("bias") else 1.0))
            elif p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    return model.eval()


def hf_checkpoint(model_type: str, path: Path, seed: int = 0, **overrides: Any) -> tuple[Any, Path]:
    """Save a random transformers model of ``model_type`` to ``path``; returns (model, path)."""
    model = hf_model(model_type, seed, **overrides)
    model.save_pretrained(path)
    if model_type == "kimi_k2":  # no kimi_k2 class in transformers: same weights, Kimi's model_type
        edit_config(path, model_type="kimi_k2")
    return model, path


def edit_config(path: Path, **changes: Any) -> dict[str, Any]:
    """Update keys of ``path/config.json`` (a value of ``...`` deletes the key)."""
    file = path / "config.json"
    cfg = json.loads(file.read_text())
    for key, value in changes.items():
        if value is ...:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    file.write_text(json.dumps(cfg, indent=2))
    return cfg


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> None:
    """Replace the checkpoint's safetensors by ``tensors`` in one file or ``shards`` files + index."""
    for file in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        file.unlink(missing_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def add_mtp_layer(
    model: Any,
    path: Path,
    *,
    own_embed: bool = True,
    own_head: bool = True,
    seed: int = 1,
    shards: int = 2,
    template_layer: int | None = None,
) -> dict[str, torch.Tensor]:
    """Add MTP layer ``num_hidden_layers`` to the checkpoint at ``path``: the tensor names of decoder layer
    ``template_layer`` (default the last; random values), enorm, hnorm, eh_proj, shared_head.norm and
    optionally its own embed_tokens / shared_head.head. Sets num_nextn_predict_layers=1 and re-saves
    sharded. Returns the MTP tensors by name."""
    cfg = model.config
    n, h = cfg.num_hidden_layers, cfg.hidden_size
    tensors = read_tensors(path)
    gen = torch.Generator().manual_seed(seed)
    mtp: dict[str, torch.Tensor] = {}
    last = f"model.layers.{n - 1 if template_layer is None else template_layer}."
    for name, t in tensors.items():
        if name.startswith(last):
            new = f"model.layers.{n}." + name[len(last) :]
            if "norm" in name:
                mtp[new] = 1 + 0.1 * torch.randn(t.shape, generator=gen)
            elif t.dim() == 1:
                mtp[new] = 0.1 * torch.randn(t.shape, generator=gen)
            else:
                mtp[new] = torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5
    p = f"model.layers.{n}."
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"{p}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    mtp[f"{p}eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen) * (2 * h) ** -0.5
    if own_embed:
        mtp[f"{p}embed_tokens.weight"] = torch.randn(cfg.vocab_size, h, generator=gen)
    if own_head:
        mtp[f"{p}shared_head.head.weight"] = torch.randn(cfg.vocab_size, h, generator=gen) * h**-0.5
    write_tensors(path, {**tensors, **mtp}, shards=shards)
    edit_config(path, num_nextn_predict_layers=1)
    return mtp


def fused_experts(state: dict[str, torch.Tensor], n_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> transformers' fused ``mlp.experts.gate_up_proj`` (E, 2I, H) and
    ``mlp.experts.down_proj`` (E, H, I), for loading a decoder layer's state into transformers."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    if "mlp.experts.0.gate_proj.weight" in state:
        ex = [f"mlp.experts.{e}." for e in range(n_experts)]
        out["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat((state[p + "gate_proj.weight"], state[p + "up_proj.weight"])) for p in ex]
        )
        out["mlp.experts.down_proj"] = torch.stack([state[p + "down_proj.weight"] for p in ex])
    return out


def decode_vs_prefill(model: Any, seed: int = 5) -> float:
    """Max |difference| of the last token's logits between absorbed decode (after a cached prefill of
    the others) and one naive prefill of all six tokens, relative to the logits' max magnitude."""
    from mlaq.model import ModelCache

    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(seed))
    full = model.prefill(ids).logits[:, -1]
    cache = ModelCache()
    model.prefill(ids[:, :-1], cache)
    last = model.decode(ids[:, -1:], cache).logits[:, 0]
    return float((last - full).abs().max() / full.abs().max())


def deepseek_v3_with_mtp(path: Path) -> Path:
    """A random 2-layer deepseek_v3 checkpoint with one MTP layer, saved to ``path``."""
    model, _ = hf_checkpoint("deepseek_v3", path, num_hidden_layers=2)
    add_mtp_layer(model, path)
    return path
