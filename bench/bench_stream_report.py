"""Tables and the DeepSeek-V3 671B projection for bench/validate_stream.py (kept apart for its length).

Projection model, per layer of DeepSeek-V3 (FP8, 61 layers: 3 dense + 58 MoE with 256 routed experts,
8 per token, 1 shared; + 1 MTP layer; vocabulary 129,280), for the same run (streams, windows, tokens):
  read       = stored bytes / the disk's cold sequential read speed measured here
  prepare    = stored bytes x the seconds per stored byte the FP8 run spent dequantizing and casting
               weights (its weight + expert time minus its read time)
  attention  = the FP8 run's attention seconds per layer (the same attention shapes, streams and tokens)
  MLP        = the run's MLP compute per layer (expert reading excluded) x (8 + 1) / (2 + 1): compute
               grows with the experts each token runs (a dense layer's 18432-wide MLP is also 9 x 2048)
  head       = the run's head compute x 129280 / 8192, plus reading the bf16 lm_head
Reading and computing run one after the other (no overlap), as the implementation does.
"""

from __future__ import annotations

import math
from statistics import fmean

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_HEAD, MOE_I, DENSE_I = (
    7168,
    128,
    1536,
    512,
    128,
    64,
    128,
    2048,
    18432,
)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _main_layers(r: dict) -> list[dict]:
    return [x for x in r["stream"]["layers"] if 0 <= x["layer"] < r["main_layers"]]


def report(results: dict, budget: str, run: dict, bench: dict) -> str:
    lines = [
        f"Run: {run['windows']} windows x {run['context_len']} tokens; streams: bf16 reference + "
        f"{', '.join(run['schemes'])} (no fp32 noise floor); --flip-rows {run['flip_rows']}; "
        f"--memory-budget {budget}; 1 torch thread",
        "",
        "| checkpoint | size | budget | peak RSS | planned peak | wall | CPU (user+sys) | read | cold disk read |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fmt, r in results.items():
        s = r["stream"]
        lines.append(
            f"| {fmt} | {_gb(r['checkpoint_bytes'])} | {s['memory_budget_bytes'] / 2**30:.2f} GiB | "
            f"{s['peak_rss_bytes'] / 2**30:.2f} GiB | {s['plan']['estimated_peak_bytes'] / 2**30:.2f} GiB | "
            f"{r['wall_seconds']:.0f} s | {r.get('cpu_seconds', float('nan')):.0f} s | {_gb(s['bytes_read'])} | {r['disk_read_bytes_per_s'] / 1e9:.2f} GB/s |"
        )
    for fmt, r in results.items():
        lines += [
            "",
            f"{fmt}, per layer (seconds; 'weights' and 'experts' include their reads):",
            "",
            "| layer | GB read | total | read | weights | attention | MLP | experts (n) | peak RSS so far |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for x in r["stream"]["layers"]:
            name = "head" if x["layer"] < 0 else str(x["layer"])
            lines.append(
                f"| {name} | {x['bytes_read'] / 1e9:.3f} | {x['seconds']:.1f} | {x['read_seconds']:.1f} | "
                f"{x['weights_seconds']:.1f} | {x['attention_seconds']:.1f} | {x['mlp_seconds']:.1f} | "
                f"{x['expert_seconds']:.1f} ({x['experts_read']}) | {x['peak_rss'] / 2**30:.2f} GiB |"
            )
    return "\n".join(lines)


def _fp8(out: int, k: int) -> int:
    return out * k + 4 * math.ceil(out / 128) * math.ceil(k / 128)


def deepseek_v3_layer_bytes(kind: str, ds: dict) -> int:
    """Stored bytes of one DeepSeek-V3 FP8 layer ('dense', 'moe' or 'mtp'; MTP's embed / head aside)."""
    attn = (
        _fp8(Q_LORA, H)
        + _fp8(HEADS * (NOPE + ROPE), Q_LORA)
        + _fp8(KV_LORA + ROPE, H)
        + _fp8(HEADS * (NOPE + V_HEAD), KV_LORA)
        + _fp8(H, HEADS * V_HEAD)
    )
    norms = 2 * (2 * H + Q_LORA + KV_LORA)
    if kind == "dense":
        return attn + norms + 2 * _fp8(DENSE_I, H) + _fp8(H, DENSE_I)
    expert = 2 * _fp8(MOE_I, H) + _fp8(H, MOE_I)
    moe = (ds["experts"] + 1) * expert + ds["experts"] * H * 2 + ds["experts"] * 4
    extra = _fp8(H, 2 * H) + 3 * 2 * H if kind == "mtp" else 0
    return attn + norms + moe + extra


def project(results: dict, run: dict, bench: dict, ds: dict) -> str:
    r = results.get("fp8") or next(iter(results.values()))
    main = _main_layers(r)
    read = sum(x["bytes_read"] for x in main)
    prep_per_byte = sum(x["weights_seconds"] + x["expert_seconds"] - x["read_seconds"] for x in main) / read
    attention = fmean(x["attention_seconds"] for x in main)
    mlp = (
        fmean(x["mlp_seconds"] - x["expert_seconds"] for x in main)
        * (ds["per_token"] + 1)
        / (bench["per_token"] + 1)
    )
    head = next(x for x in r["stream"]["layers"] if x["layer"] < 0)
    head_compute = (head["seconds"] - head["read_seconds"]) * ds["vocab"] / 8192
    disk = r["disk_read_bytes_per_s"]
    kinds = ["dense"] * ds["dense"] + ["moe"] * (ds["layers"] - ds["dense"]) + ["mtp"] * ds["mtp"]
    total_bytes = sum(deepseek_v3_layer_bytes(k, ds) for k in kinds) + ds["vocab"] * H * 2
    t_read = total_bytes / disk
    t_prep = (total_bytes - ds["vocab"] * H * 2) * prep_per_byte
    t_attn = attention * len(kinds)
    t_mlp = mlp * len(kinds)
    total = t_read + t_prep + t_attn + t_mlp + head_compute
    per_layer = deepseek_v3_layer_bytes("moe", ds)
    # the run's share of a core: its CPU seconds over its wall seconds (the reads' waits included, so
    # this overstates the share and understates the unloaded time a little)
    share = min(1.0, r.get("cpu_seconds", r["wall_seconds"]) / r["wall_seconds"])
    compute = t_prep + t_attn + t_mlp + head_compute
    return "\n".join(
        [
            "",
            f"Projection, DeepSeek-V3 671B FP8 ({len(kinds)} layers incl. MTP, {total_bytes / 1e9:.0f} GB read; "
            f"an MoE layer {per_layer / 1e9:.2f} GB), same run ({run['windows']} x {run['context_len']} tokens, "
            f"bf16 + {len(run['schemes'])} schemes):",
            f"- read at {disk / 1e9:.2f} GB/s: {t_read / 60:.0f} min",
            f"- dequantize + cast at {1 / prep_per_byte / 1e9:.2f} GB/s of stored bytes: {t_prep / 60:.0f} min",
            f"- attention {attention:.1f} s/layer: {t_attn / 60:.0f} min",
            f"- MLP {mlp:.1f} s/layer (measured x {(ds['per_token'] + 1) / (bench['per_token'] + 1):.1f}): "
            f"{t_mlp / 60:.0f} min",
            f"- head: {head_compute / 60:.1f} min",
            f"- total: {total / 3600:.1f} h ({total / len(kinds):.0f} s per layer)",
            f"- on one unloaded core (compute x {share:.2f}, the run's CPU / wall): "
            f"{(compute * share + t_read) / 3600:.1f} h at this disk, "
            f"{(compute * share + total_bytes / 3e9) / 3600:.1f} h at 3 GB/s (NVMe)",
        ]
    )
