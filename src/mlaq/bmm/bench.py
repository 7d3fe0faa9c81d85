"""Time every BMM scheme and one absorbed MLA decode step, next to memcpy bandwidth.

What is timed is mlaq's exact CPU EMULATION of each scheme (prepare = load-time quantization, apply =
both absorbed BMMs), not a GPU kernel: it says what the emulation costs, and, through bytes/time
against the memory-copy bandwidth of the same run, how far a step is from being memory bound.
Bytes are nominal: what a real kernel reads (weight codes + scales at their true granularity,
bf16 activations, the bf16 latent cache), not what the emulation touches.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

SCHEMES = (
    "bf16",
    "fp8_per_tensor",
    "fp8_per_head",
    "fp8_per_channel",
    "fp8_per_block",
    "mxfp4",
    "mxfp4_w4a16",
    "mxfp8",
)


@dataclass(frozen=True)
class BenchConfig:
    schemes: tuple[str, ...]
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    reps: int
    max_cache_gib: float
    step_scheme: str
    copy_mib: int
    threads: int  # torch intra-op threads; 0 = torch's default


@dataclass(frozen=True)
class Geometry:
    """The absorbed-attention sizes of one model family (DeepSeek-V3 config names)."""

    name: str
    num_heads: int  # N
    kv_lora_rank: int  # L
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V


GEOMETRIES = (Geometry("DeepSeek-V3", 128, 512, 128, 64, 128), Geometry("GLM-5", 64, 512, 192, 64, 256))


def _median_s(fn: Callable[[], object], reps: int, warmup: bool = True) -> float:
    if warmup:
        fn()  # first-call allocations and kernel selection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(mib: int, reps: int) -> float:
    """Bandwidth of a large tensor copy (read + write bytes / time), the same run's roofline."""
    import torch

    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_s(lambda: dst.copy_(src), max(reps, 3)) / 1e9


def bench_schemes(geo: Geometry, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Per scheme: prepare of W_UK and W_UV^T, apply of both BMMs per batch size, weight bytes."""
    import torch

    from mlaq.bmm import get_scheme

    n, lr, p, v = geo.num_heads, geo.kv_lora_rank, geo.qk_nope_head_dim, geo.v_head_dim
    g = torch.Generator().manual_seed(0)
    w_uk = (torch.randn(n, p, lr, generator=g) * 0.02).bfloat16()  # (N, K=P, M=L)
    w_uv = (torch.randn(n, lr, v, generator=g) * 0.02).bfloat16()  # (N, K=L, M=V)
    rows = []
    for name in cfg.schemes:
        scheme = get_scheme(name)
        prep_s = _median_s(lambda s=scheme: (s.prepare(w_uk), s.prepare(w_uv)), cfg.reps, warmup=False)
        uk, uv = scheme.prepare(w_uk), scheme.prepare(w_uv)
        weight_bytes = uk.storage_bytes() + uv.storage_bytes()
        apply_ms, gbps = {}, {}
        for b in cfg.batches:
            q = torch.randn(n, b, p, generator=g).bfloat16()
            o = torch.randn(n, b, lr, generator=g).bfloat16()
            t = _median_s(lambda s=scheme, q=q, o=o, uk=uk, uv=uv: (s.apply(q, uk), s.apply(o, uv)), cfg.reps)
            act_bytes = 2 * n * b * (p + lr + lr + v)  # bf16 in and out of both BMMs
            apply_ms[b], gbps[b] = t * 1e3, (weight_bytes + act_bytes) / t / 1e9
        rows.append(
            {"geometry": geo.name, "scheme": name, "prepare_ms": prep_s * 1e3, "weight_bytes": weight_bytes}
            | {"apply_ms": apply_ms, "gbps": gbps}
        )
    return rows


def decode_step(q_nope, q_pe, cache, uk, uv, scheme, geo: Geometry, softmax_scale: float):
    """One absorbed MLA decode step for B requests (each one new token against its own cache).

    q_nope (N, B, P), q_pe (B, N, R), cache (B, T, L + R) = [c_kv | k_pe], all bf16 -> (N, B, V).
    """
    import torch

    lr = geo.kv_lora_rank
    ql = scheme.apply(q_nope, uk).to(torch.bfloat16).transpose(0, 1)  # q absorption: (N,B,L) -> (B,N,L)
    q = torch.cat([ql, q_pe], dim=-1)  # (B, N, L + R): one product against [c_kv | k_pe]
    scores = torch.bmm(q, cache.transpose(1, 2)).float() * softmax_scale  # (B, N, T)
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    o_latent = torch.bmm(probs, cache[:, :, :lr])  # (B, N, L)
    return scheme.apply(o_latent.transpose(0, 1), uv)  # V up-projection: (N, B, V)


def bench_decode(geo: Geometry, cfg: BenchConfig) -> list[dict[str, Any]]:
    """Time of one absorbed decode step per (batch, context); the two BMMs' share of it."""
    import torch

    from mlaq.bmm import get_scheme

    n, lr, p, r, v = (
        geo.num_heads,
        geo.kv_lora_rank,
        geo.qk_nope_head_dim,
        geo.qk_rope_head_dim,
        geo.v_head_dim,
    )
    scheme = get_scheme(cfg.step_scheme)
    g = torch.Generator().manual_seed(1)
    uk = scheme.prepare((torch.randn(n, p, lr, generator=g) * 0.02).bfloat16())
    uv = scheme.prepare((torch.randn(n, lr, v, generator=g) * 0.02).bfloat16())
    rows = []
    for b in cfg.batches:
        q_nope = torch.randn(n, b, p, generator=g).bfloat16()
        q_pe = torch.randn(b, n, r, generator=g).bfloat16()
        o = torch.randn(n, b, lr, generator=g).bfloat16()
        bmm_s = _median_s(lambda q=q_nope, o=o: (scheme.apply(q, uk), scheme.apply(o, uv)), cfg.reps)
        for ctx in cfg.contexts:
            cache_bytes = b * ctx * (lr + r) * 2
            row: dict[str, Any] = {
                "geometry": geo.name,
                "batch": b,
                "context": ctx,
                "cache_bytes": cache_bytes,
            }
            if cache_bytes > cfg.max_cache_gib * 2**30:
                rows.append(
                    row | {"skipped": f"latent cache {cache_bytes / 2**30:.2f} GiB > --max-cache-gib"}
                )
                continue
            cache = torch.randn(b, ctx, lr + r, generator=g, dtype=torch.bfloat16)
            step = functools.partial(decode_step, q_nope, q_pe, cache, uk, uv, scheme, geo, (p + r) ** -0.5)
            t = _median_s(step, cfg.reps)
            moved = cache_bytes + uk.storage_bytes() + uv.storage_bytes()
            rows.append(row | {"step_ms": t * 1e3, "bmm_ms": bmm_s * 1e3, "gbps": moved / t / 1e9})
            del cache, step
    return rows


def machine() -> dict[str, Any]:
    import torch

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_1min": load,
    }


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return {
        "machine": machine(),
        "torch": torch.__version__,
        "config": asdict(cfg),
        "memcpy_gbps": memcpy_gbps(cfg.copy_mib, cfg.reps),
        "bmm": [row for geo in GEOMETRIES for row in bench_schemes(geo, cfg)],
        "decode": [row for geo in GEOMETRIES for row in bench_decode(geo, cfg)],
    }


def format_tables(result: dict[str, Any]) -> str:
    """Plain aligned text: machine, memcpy roofline, the scheme table and the decode table per geometry."""
    m, cfg, copy = result["machine"], result["config"], result["memcpy_gbps"]
    out = [
        "mlaq bench-bmm: CPU emulation of the absorbed-MLA BMM schemes (times are medians)",
        f"machine: {m['cpu']}, {m['cores']} cores, torch {result['torch']} ({m['torch_threads']} threads), "
        f"1-min load {m['load_1min']:.1f}",
        f"memory copy: {copy:.1f} GB/s (read + write of {cfg['copy_mib']} MiB)",
    ]
    batches = cfg["batches"]
    for geo in GEOMETRIES:
        out += [
            "",
            f"{geo.name} (N={geo.num_heads}, L={geo.kv_lora_rank}, P={geo.qk_nope_head_dim}, "
            f"V={geo.v_head_dim}): prepare W_UK + W_UV, apply both BMMs (ms); GB/s = nominal bytes / time",
        ]
        head = f"{'scheme':<16}{'weight MiB':>11}{'prepare':>10}" + "".join(
            f"{'B=' + str(b):>10}" for b in batches
        )
        out.append(head + "".join(f"{'GB/s B=' + str(b):>12}" for b in batches))
        for r in (r for r in result["bmm"] if r["geometry"] == geo.name):
            line = f"{r['scheme']:<16}{r['weight_bytes'] / 2**20:>11.2f}{r['prepare_ms']:>10.1f}"
            line += "".join(f"{r['apply_ms'][b]:>10.2f}" for b in batches)
            out.append(line + "".join(f"{r['gbps'][b]:>12.2f}" for b in batches))
    out += [
        "",
        f"Absorbed decode step ({cfg['step_scheme']} BMMs): q absorption, scores against the latent "
        "cache (ctx, 512+64) bf16, softmax fp32, o_latent, V up-projection",
        f"{'geometry':<12}{'B':>4}{'context':>9}{'cache MiB':>11}{'step ms':>10}{'BMMs ms':>10}"
        f"{'BMM share':>11}{'GB/s':>8}{'of memcpy':>11}",
    ]
    for r in result["decode"]:
        line = f"{r['geometry']:<12}{r['batch']:>4}{r['context']:>9}{r['cache_bytes'] / 2**20:>11.1f}"
        if "skipped" in r:
            out.append(f"{line}  skipped: {r['skipped']}")
            continue
        share = r["bmm_ms"] / r["step_ms"]
        out.append(
            f"{line}{r['step_ms']:>10.2f}{r['bmm_ms']:>10.2f}{share:>11.1%}{r['gbps']:>8.1f}"
            f"{r['gbps'] / copy:>11.0%}"
        )
    return "\n".join(out)
