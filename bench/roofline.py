"""Batch-1 decode roofline: weight bytes one token reads, single-thread read bandwidth, the floor.

    .venv/bin/python bench/roofline.py                 # bundled mlaq-tiny-4k, 1 thread
    .venv/bin/python bench/roofline.py --model DIR --threads 2

At batch 1 every weight a token uses is read once per token and reused by nothing else, so a decode
step cannot be faster than (bytes of active weights) / (read bandwidth). Active weights of a
DeepSeek-V3-style checkpoint: per layer MLA (q_a, q_b or q_proj, kv_a, kv_b = the absorbed W_UK /
W_UV, o_proj, norms) plus the MLP (dense, or router + top-k routed + shared experts); then the final
norm, one embedding row and lm_head. The KV cache a token reads (S * (L + R) values a layer) is
printed too; it is small at these lengths. Bandwidth = the best of timed ``torch.sum`` over a buffer
of the active weights' size (a GEMV at batch 1 streams its weight the same way), per dtype.

The floor counts bytes only. Over a cache of S tokens a decode token also does arithmetic that no
byte count shows: per layer and head, S scores of L + R multiply-adds and S values of L (FlashMLA's
absorbed attention), float32 in mlaq's kernel. ``--context S`` prints that too, at the best float32
GEMM rate torch reaches here (``torch.mm`` of 1024 x 1024, the same threads): the step cannot beat
weights / bandwidth + attention FLOPs / that rate (the attention needs the layer's queries, so it
follows the layer's projections; it cannot hide behind them).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src/mlaq/assets/mlaq-tiny-4k"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def active_params(c: dict) -> dict[str, int]:
    """Parameters one decode token reads, by part, from a DeepSeek-V2/V3 config.json."""
    h, n = c["hidden_size"], c["num_attention_heads"]
    p, r, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    lora, q_lora = c["kv_lora_rank"], c.get("q_lora_rank")
    q = h * n * (p + r) if q_lora is None else h * q_lora + q_lora + q_lora * n * (p + r)
    attn = q + h * (lora + r) + lora + lora * n * (p + v) + n * v * h + 2 * h  # + both layer norms
    layers, dense = c["num_hidden_layers"], c.get("first_k_dense_replace", 0)
    experts = c.get("n_routed_experts") or 0
    moe_inter = c.get("moe_intermediate_size", 0)
    routed = c.get("num_experts_per_tok", 0) * 3 * h * moe_inter
    shared = (c.get("n_shared_experts") or 0) * 3 * h * moe_inter
    moe = experts * h + experts + routed + shared  # router weight and score-correction bias
    mlp_dense = 3 * h * c["intermediate_size"]
    n_moe = layers - dense if experts else 0
    return {
        "attention (MLA)": layers * attn,
        "dense MLP": (layers - n_moe) * mlp_dense,
        "MoE (router + top-k + shared)": n_moe * moe,
        "lm_head + norm + embedding row": c["vocab_size"] * h + 2 * h,
    }


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call (first touch)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth(nbytes: int, dtype: torch.dtype, repeats: int = 20) -> float:
    """Bytes per second of the best timed ``torch.sum`` over ``nbytes`` of ``dtype``."""
    x = torch.ones(nbytes // torch.finfo(dtype).bits * 8, dtype=dtype)
    return x.numel() * x.element_size() / best_seconds(x.sum, repeats)


def gemm_rate(repeats: int = 10) -> float:
    """FLOP/s of the best timed float32 ``torch.mm`` of 1024 x 1024 x 1024 (the machine's usable peak)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    return 2 * 1024**3 / best_seconds(lambda: a @ b, repeats)


def attention_flops(c: dict, context: int) -> int:
    """FLOPs of one decode token's absorbed attention over ``context`` cached tokens, all layers."""
    lora, r = c["kv_lora_rank"], c["qk_rope_head_dim"]
    return 2 * c["num_hidden_layers"] * c["num_attention_heads"] * context * ((lora + r) + lora)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=64, help="cached tokens S for the KV-cache bytes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    config = json.loads((args.model / "config.json").read_text())
    parts = active_params(config)
    total = sum(parts.values())
    print(f"model: {args.model}, {args.threads} thread(s), torch {torch.__version__}\n")
    for name, count in parts.items():
        print(f"  {name:32s} {count / 1e6:7.3f} M params")
    print(f"  {'active per decode token':32s} {total / 1e6:7.3f} M params")
    kv = config["num_hidden_layers"] * args.context * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    label = f"KV cache read (S = {args.context})"
    print(f"  {label:32s} {kv / 1e6:7.3f} M values\n")
    rate = gemm_rate()
    flops = attention_flops(config, args.context)
    attend = flops / rate
    print(
        f"  attention arithmetic (S = {args.context}): {flops / 1e6:.1f} MFLOP a token; float32 GEMM "
        f"{rate / 1e9:.0f} GFLOP/s ({args.threads} thread(s)): >= {attend * 1e3:.3f} ms\n"
    )
    print(
        "| dtype | weight MB / token | read GB/s | floor ms / token | ceiling tok/s "
        "| floor + attention arithmetic ms | its ceiling tok/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, dtype in DTYPES.items():
        nbytes = (total + kv) * torch.finfo(dtype).bits // 8
        bandwidth = read_bandwidth(nbytes, dtype)
        floor = nbytes / bandwidth
        both = floor + attend
        print(
            f"| {name} | {nbytes / 1e6:.1f} | {bandwidth / 1e9:.1f} | {floor * 1e3:.3f} | {1 / floor:.0f} "
            f"| {both * 1e3:.3f} | {1 / both:.0f} |"
        )


if __name__ == "__main__":
    main()
