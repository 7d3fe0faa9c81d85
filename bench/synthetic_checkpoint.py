"""A full-size synthetic DeepSeek-V3 checkpoint that costs ~2 GB of disk: only kv_b_proj holds data.

Every tensor of the real checkpoint (names, shapes, dtypes; 61 decoder layers + 1 MTP layer, 256
routed experts, FP8 ``weight_scale_inv`` beside every quantized linear) is present in the headers of
163 shards listed by ``model.safetensors.index.json``, as in deepseek-ai/DeepSeek-V3. The files are
sparse: the 8-byte length and the JSON header are written, each kv_b_proj (and its scale) is written
at its offset, and the file is extended to its full length without writing the rest (a hole, read
back as zeros by anyone who reads it: an audit must not). bf16 apparent size ~1.3 TB, fp8 ~0.7 TB.

kv_b_proj values: Gaussian with a per-head scale (log-normal, sigma 0.3) and, in a few layers,
heavy-tailed outlier columns, so layers differ and the ranking has something to rank.

    python bench/synthetic_checkpoint.py DIR [--fp8] [--config CONFIG_DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from mlaq.formats import Fp8Dtype, quantize_fp8

CONFIG = Path(__file__).resolve().parents[1] / "tests/fixtures/configs/deepseek-ai--DeepSeek-V3"
SHARDS = 163
_ST = {torch.bfloat16: "BF16", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32"}
_SIZE = {"BF16": 2, "F8_E4M3": 1, "F32": 4}


def tensors(cfg: dict, fp8: bool) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor, in the real checkpoint's layer order."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n, p, r, vd = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
    )
    lora, qlora = cfg["kv_lora_rank"], cfg["q_lora_rank"]
    dense = "BF16"
    yield "model.embed_tokens.weight", dense, (v, h)

    def linear(name: str, out: int, k: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
        if fp8:
            yield f"{name}.weight", "F8_E4M3", (out, k)
            yield f"{name}.weight_scale_inv", "F32", (math.ceil(out / 128), math.ceil(k / 128))
        else:
            yield f"{name}.weight", dense, (out, k)

    layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    for i in range(layers):
        pre = f"model.layers.{i}"
        if i >= cfg["num_hidden_layers"]:  # MTP: its own embedding, projections and head
            yield f"{pre}.embed_tokens.weight", dense, (v, h)
            yield f"{pre}.enorm.weight", dense, (h,)
            yield f"{pre}.hnorm.weight", dense, (h,)
            yield f"{pre}.eh_proj.weight", dense, (h, 2 * h)
            yield f"{pre}.shared_head.norm.weight", dense, (h,)
            yield f"{pre}.shared_head.head.weight", dense, (v, h)
        yield f"{pre}.input_layernorm.weight", dense, (h,)
        yield f"{pre}.post_attention_layernorm.weight", dense, (h,)
        a = f"{pre}.self_attn"
        yield from linear(f"{a}.q_a_proj", qlora, h)
        yield f"{a}.q_a_layernorm.weight", dense, (qlora,)
        yield from linear(f"{a}.q_b_proj", n * (p + r), qlora)
        yield from linear(f"{a}.kv_a_proj_with_mqa", lora + r, h)
        yield f"{a}.kv_a_layernorm.weight", dense, (lora,)
        yield from linear(f"{a}.kv_b_proj", n * (p + vd), lora)
        yield from linear(f"{a}.o_proj", h, n * vd)
        m = f"{pre}.mlp"
        if i < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            yield from linear(f"{m}.gate_proj", inter, h)
            yield from linear(f"{m}.up_proj", inter, h)
            yield from linear(f"{m}.down_proj", h, inter)
            continue
        e, inter = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
        yield f"{m}.gate.weight", dense, (e, h)
        yield f"{m}.gate.e_score_correction_bias", "F32", (e,)
        for x in [*(f"experts.{j}" for j in range(e)), "shared_experts"]:
            width = inter * (cfg["n_shared_experts"] if x == "shared_experts" else 1)
            yield from linear(f"{m}.{x}.gate_proj", width, h)
            yield from linear(f"{m}.{x}.up_proj", width, h)
            yield from linear(f"{m}.{x}.down_proj", h, width)
    yield "model.norm.weight", dense, (h,)
    yield "lm_head.weight", dense, (v, h)


def kv_b_weight(layer: int, cfg: dict) -> torch.Tensor:
    """A kv_b_proj [N*(P+V), L] with per-head scales and, every 7th layer, heavy-tailed columns."""
    g = torch.Generator().manual_seed(1000 + layer)
    n, rows_per_head, lora = (
        cfg["num_attention_heads"],
        cfg["qk_nope_head_dim"] + cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    w = torch.randn(n, rows_per_head, lora, generator=g)
    w *= torch.exp(0.3 * torch.randn(n, 1, 1, generator=g)) * lora**-0.5  # per-head scale
    if layer % 7 == 3:  # a few latent dims with 8x larger weights: outliers along L
        cols = torch.randint(0, lora, (4,), generator=g)
        w[:, :, cols] *= 8.0
    return w.reshape(n * rows_per_head, lora)


def data_for(name: str, layer: int, cfg: dict, fp8: bool) -> bytes:
    w = kv_b_weight(layer, cfg)
    if not fp8:
        return w.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
    q = quantize_fp8(w, Fp8Dtype.E4M3FN, (128, 128))  # DeepSeek-V3's own block arithmetic
    t = q.codes if name.endswith(".weight") else q.scale.float()
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def write(out: Path, fp8: bool, config_dir: Path = CONFIG) -> dict:
    """Write the checkpoint into ``out``; returns {"files", "apparent_bytes", "kv_b_bytes"}."""
    cfg = json.loads((config_dir / "config.json").read_text())
    if not fp8:
        cfg.pop("quantization_config", None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    entries = list(tensors(cfg, fp8))
    sizes = [math.prod(s) * _SIZE[d] for _, d, s in entries]
    per_shard = sum(sizes) / SHARDS
    shards: list[list[int]] = [[]]
    acc = 0
    for j, size in enumerate(sizes):
        if acc >= per_shard * len(shards) and len(shards) < SHARDS:
            shards.append([])
        shards[-1].append(j)
        acc += size
    weight_map, kv_b_bytes = {}, 0
    for s, idx in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):06d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for j in idx:
            name, dtype, shape = entries[j]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + sizes[j]]}
            offset += sizes[j]
            weight_map[name] = fname
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        base = 8 + len(raw)
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for j in idx:
                name = entries[j][0]
                if ".self_attn.kv_b_proj." in name:
                    data = data_for(name, int(name.split(".")[2]), cfg, fp8)
                    f.seek(base + header[name]["data_offsets"][0])
                    f.write(data)
                    kv_b_bytes += len(data)
            f.truncate(base + offset)  # the rest stays a hole
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {"files": len(shards), "apparent_bytes": sum(sizes), "kv_b_bytes": kv_b_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--fp8", action="store_true", help="block-FP8 (e4m3 + weight_scale_inv), as released")
    ap.add_argument("--config", type=Path, default=CONFIG, help="directory with DeepSeek-V3's config.json")
    args = ap.parse_args()
    info = write(args.out, args.fp8, args.config)
    disk = sum(os.stat(f).st_blocks * 512 for f in args.out.glob("*.safetensors"))
    print(json.dumps({**info, "disk_bytes": disk}), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
