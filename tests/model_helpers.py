"""Builders of tiny checkpoints for the model tests.

- ``hf_checkpoint``: a random model of one architecture built and saved by transformers itself (the
  oracle), small dims but the real head geometry (DeepSeek P=128/R=64/V=128, GLM P=192/R=64/V=256).
- ``add_mtp_layer``: adds random MTP tensors (transformers drops them) and re-saves the checkpoint sharded.
- ``quantize_checkpoint``: rewrites a checkpoint in a real on-disk quantized format (DeepSeek block FP8,
  Quark MXFP4, compressed-tensors FP8) with quantizers written here independently of mlaq (ml_dtypes for
  the element casts); returns the exact dequantized value of every tensor it quantized.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
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


# ---- quantized checkpoints, in the real on-disk formats -------------------------------------------


def fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block FP8: (e4m3fn codes, weight_scale_inv [ceil(out/b), ceil(in/b)], exact dequant)."""
    out, k = w.shape
    gr, gc = math.ceil(out / block), math.ceil(k / block)
    scale = torch.empty(gr, gc)
    codes = torch.empty(out, k, dtype=torch.float8_e4m3fn)
    for i in range(gr):
        for j in range(gc):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block].double()
            s = float(blk.abs().max()) / 448.0 or 1.0
            scale[i, j] = s
            q = np.asarray((blk / torch.tensor(s, dtype=torch.float32).double()).numpy(), dtype=np.float32)
            q8 = np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn)
            codes[i * block : (i + 1) * block, j * block : (j + 1) * block] = torch.from_numpy(
                q8.view(np.uint8)
            ).view(torch.float8_e4m3fn)
    full = scale.repeat_interleave(block, 0)[:out].repeat_interleave(block, 1)[:, :k]
    return codes, scale, (codes.double() * full.double()).float()


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quark MXFP4 along the input axis, FLOOR scale rule: (packed uint8 [out, in/2], E8M0 uint8
    [out, ceil(in/32)], exact dequant)."""
    out, k = w.shape
    blocks = w.double().reshape(out, k // 32, 32)
    amax = blocks.abs().amax(-1)
    u = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = (blocks / torch.exp2(u)[..., None]).float().numpy()
    q4 = np.clip(scaled, -6, 6).astype(ml_dtypes.float4_e2m1fn)  # RNE, ml_dtypes as the oracle
    values = torch.from_numpy(q4.astype(np.float32)).double() * torch.exp2(u)[..., None]
    nibbles = torch.from_numpy(q4.view(np.uint8).astype(np.uint8) & 0x0F).reshape(out, k)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # element 2i in the low nibble
    return packed.to(torch.uint8), (u + 127).to(torch.uint8), values.reshape(out, k).float()


def _is_quantizable(name: str) -> bool:
    excluded = ("norm", "embed_tokens", "lm_head", "mlp.gate.", "shared_head.head", "indexer", "eh_proj")
    return name.endswith(".weight") and not any(e in name for e in excluded)


def quantize_checkpoint(
    path: Path, method: str, *, skip: tuple[str, ...] = (), strategy: str = "block"
) -> dict[str, torch.Tensor]:
    """Rewrite the 2-D linear weights of ``path`` in ``method``'s format ("fp8", "quark_mxfp4",
    "compressed-tensors" with ``strategy`` tensor/channel/block); modules whose name contains a string
    of ``skip`` stay unquantized (and are listed as excluded). Returns {module.weight: exact dequant}."""
    tensors = read_tensors(path)
    out: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if t.dim() != 2 or not _is_quantizable(name) or any(s in name for s in skip):
            out[name] = t
            continue
        if method == "fp8" or (method == "compressed-tensors" and strategy == "block"):
            codes, scale, value = fp8_block(t)
            key = "weight_scale_inv" if method == "fp8" else "weight_scale"
            out[name], out[f"{module}.{key}"] = codes, scale
        elif method == "compressed-tensors":
            amax = t.abs().amax() if strategy == "tensor" else t.abs().amax(dim=1, keepdim=True)
            scale = (amax / 448.0).float()
            codes = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            value = (codes.double() * scale.double()).float()
            out[name], out[f"{module}.weight_scale"] = (
                codes,
                scale.reshape(-1) if strategy == "tensor" else scale,
            )
        elif method == "quark_mxfp4":
            packed, scales, value = mxfp4(t)
            out[name], out[f"{module}.weight_scale"] = packed, scales
        else:
            raise ValueError(method)
        expected[name] = value
    write_tensors(path, out)
    edit_config(path, quantization_config=_quant_config(method, skip, strategy))
    return expected


def _quant_config(method: str, skip: tuple[str, ...], strategy: str) -> dict[str, Any]:
    if method == "fp8":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [f"re:.*{s}.*" for s in skip] or None,
        }
    if method == "quark_mxfp4":
        mx = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
        return {
            "quant_method": "quark",
            "global_quant_config": {
                "weight": {**mx, "is_dynamic": False},
                "input_tensors": {**mx, "is_dynamic": True},
            },
            "exclude": ["lm_head", "re:.*mlp.gate$", *[f"re:.*{s}.*" for s in skip]],
            "layer_quant_config": {},
        }
    weights: dict[str, Any] = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
    if strategy == "block":
        weights["block_structure"] = [128, 128]
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head", "re:.*mlp.gate$", *[f"re:.*{s}.*" for s in skip]],
    }
