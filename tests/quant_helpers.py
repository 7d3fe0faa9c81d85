"""Quantized checkpoints in their real on-disk formats, for the loader tests.

``quantize_checkpoint`` rewrites a checkpoint as DeepSeek block FP8, Quark MXFP4 or compressed-tensors
FP8, with quantizers written here independently of mlaq (ml_dtypes for the element casts), and returns
the exact dequantized value of every tensor it quantized.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import torch

from model_helpers import edit_config, read_tensors, write_tensors


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
    path: Path,
    method: str,
    *,
    skip: tuple[str, ...] = (),
    strategy: str = "block",
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Rewrite the 2-D linear weights of ``path`` in ``method``'s format ("fp8", "quark_mxfp4",
    "compressed-tensors" with ``strategy`` tensor/channel/block); modules whose name contains a string
    of ``skip`` stay unquantized (and are listed as excluded). compressed-tensors tensor/channel scales
    are stored as ``scale_dtype`` (llm-compressor writes them in the model's dtype, e.g. bf16): per-tensor
    shape [1], per-channel [out, 1]. Returns {module.weight: exact dequant}."""
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
            scale = (amax / 448.0).to(scale_dtype)
            codes = (t / scale.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
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
                "input_tensors": None,  # W4A16: mlaq refuses W4A4 linears (test_loader_quark_w4a4.py)
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
