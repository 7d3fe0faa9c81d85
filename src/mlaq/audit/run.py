"""``audit``: read every MLA layer's kv_b_proj (and nothing else) and measure what each scheme does to it.

Per layer: the stored weight is decoded by the loader's own reader and dequantized exactly (an FP8
checkpoint with its scales, as an engine does before re-quantizing), split into W_UK (N, P, L) and
W_UV^T (N, L, V), and each scheme's weights are built exactly as ``load_model`` builds them under
``--quantization-config '{"targets": {"re:.*kv_b_proj": SCHEME}}'`` (``mlaq.model.loading.kv_b.prepare_absorbed``,
so a scheme that runs the checkpoint's own data costs nothing). The figures: ``mlaq.audit.measure``
(in place, in per-worker buffers), bit for bit those ``mlaq.audit.stats`` states plainly. The result is
one JSON-ready record; report.md, report.json, the PNG and the terminal table all read only that record.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from queue import Queue
from typing import Any

import torch

from mlaq.audit.layers import Geometry, audited_layers, check_readable, loader_quant
from mlaq.audit.measure import Workspace, exact_into, measure, scheme_figures
from mlaq.audit.source import RangeCheckpoint
from mlaq.bmm import get_scheme, scheme_names, split_kv_b_proj
from mlaq.bmm.mx import MX_BLOCK
from mlaq.bmm.theory import theory_for
from mlaq.model.loading.checkpoint import check_finite
from mlaq.model.loading.kv_b import check_stored, prepare_absorbed
from mlaq.model.loading.range_reader import RangeReader
from mlaq.model.loading.weights import WeightFormat, read_linear
from mlaq.policy import PolicyResult, checkpoint_quant, decide, mla_model, parse_explicit, read_checkpoint_dir
from mlaq.policy.explicit import load_explicit, policy_config
from mlaq.progress import NullProgress, Progress
from mlaq.settings import Settings

ALL_KV_B = r"re:.*self_attn\.kv_b_proj$"


def _as_scheme(model: Any, quant: Any, settings: Settings, scheme: str) -> PolicyResult:
    """Every layer under ``scheme``, as an explicit targets config decides it."""
    explicit = parse_explicit({"targets": {ALL_KV_B: scheme}}, scheme_names())
    return decide(model, quant, settings, explicit)


def audit(
    path: str | Path,
    schemes: tuple[str, ...],
    settings: Settings,
    quantization_config: str | None = None,
    quantization: str | None = None,
    *,
    progress: Progress | None = None,
    reader: RangeReader | None = None,
    workers: int = 1,
) -> dict[str, Any]:
    """Audit the checkpoint at ``path`` under ``schemes``; the policy column follows ``settings`` and
    ``quantization_config`` (``--quantization-config`` text); ``workers`` layers run at once (threads,
    one torch thread each; torch's thread count is restored afterwards). Returns the report record."""
    start = time.perf_counter()
    for s in schemes:
        get_scheme(s)  # an unknown name: one line listing the known ones
    files = read_checkpoint_dir(path)
    model = mla_model(files.config, files.layers_prefix)
    geo = Geometry.from_config(files.config)
    ckpt = RangeCheckpoint(path, reader)
    layers, note = audited_layers(model, ckpt)
    quant = checkpoint_quant(files)
    stored_names = check_readable(model, quant, layers)
    wquant = loader_quant(quant, files.config)
    explicit = policy_config(quantization_config, quantization)  # vLLM's meaning under "online"
    if isinstance(explicit, str):
        explicit = load_explicit(explicit, scheme_names())
    policy = decide(model, quant, settings, explicit)
    per_scheme = {s: _as_scheme(model, quant, settings, s) for s in schemes}
    progress = progress or NullProgress()
    progress.begin(len(layers))
    records = []
    # Layers are independent and torch releases the GIL in its kernels: `workers` threads overlap them,
    # each with its own scratch buffers. One intra-op thread each: no oversubscription, and figures
    # (torch's full reductions depend on the thread count) that are the same on every machine.
    workers = max(1, workers)
    workspaces: Queue[Workspace] = Queue()
    for _ in range(workers):
        workspaces.put(Workspace())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="mlaq-audit")
    try:
        futures = [
            pool.submit(_layer, ckpt, wquant, model, geo, i, policy, per_scheme, stored_names[i], workspaces)
            for i in layers
        ]
        for i, future in zip(layers, futures, strict=True):
            progress.step(f"layer {i}" + (" (MTP)" if model.is_mtp(i) else ""))
            records.append(future.result())
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        progress.end(ok=False)
        raise
    finally:
        torch.set_num_threads(threads)
    pool.shutdown()
    progress.end()
    return _record(path, model, geo, quant, settings, explicit, schemes, layers, note, records, ckpt, start)


@torch.no_grad()
def _layer(
    ckpt: RangeCheckpoint,
    wquant: Any,
    model: Any,
    geo: Geometry,
    i: int,
    policy: PolicyResult,
    per_scheme: dict[str, PolicyResult],
    stored_name: str,
    workspaces: Queue[Workspace],
) -> dict[str, Any]:
    module = model.kv_b_proj(i)
    n, p, v = geo.num_heads, geo.qk_nope_head_dim, geo.v_head_dim
    stored = read_linear(ckpt, wquant, module, geo.kv_b_shape)  # type: ignore[arg-type]
    decisions = {name: result.for_layer(i) for name, result in per_scheme.items()}
    for decision in decisions.values():
        check_stored(decision, stored)
    # the loader's own weights where a scheme runs the checkpoint's data (W_UK, W_UV^T each)
    own = {s: prepare_absorbed(d, stored, n, p, v) for s, d in decisions.items() if d.uses_checkpoint_data}
    current = policy.for_layer(i)
    out: dict[str, Any] = {
        "layer": i,
        "module": module,
        "mtp": model.is_mtp(i),
        "stored": stored_name,
        "policy": {"scheme": current.scheme, "rule": current.rule.value, "reason": current.reason},
        "w_uk": None,
        "w_uv": None,
        "schemes": {
            s: {"uses_checkpoint_data": d.uses_checkpoint_data, "scheme_uk": d.scheme_uk}
            for s, d in decisions.items()
        },
    }
    mx_block = MX_BLOCK if any(name.startswith("mx") for name in per_scheme) else None
    bf16_exact = stored.format is WeightFormat.DENSE and stored.codes.dtype == torch.bfloat16
    ws = workspaces.get()
    try:
        exact = exact_into(stored, ws)  # [N*(P+V), L] fp32, the exact value
        if not math.isfinite(float(exact.sum())):  # one pass; any NaN/inf makes the sum non-finite
            check_finite(exact, ckpt.where(f"{module}.weight"))  # names the count
        for h, (key, half) in enumerate(zip(("w_uk", "w_uv"), split_kv_b_proj(exact, n, p, v), strict=True)):
            w = ws.get("w", tuple(half.shape)).copy_(half)  # (N, P, L) or (N, L, V), contiguous
            ref = measure(w, ws, bf16_exact=bf16_exact, mx_block=mx_block)
            out[key] = ref.stats.to_json()
            for s, d in decisions.items():
                scheme = get_scheme(d.scheme_uk if h == 0 else d.scheme)
                prepared = own[s][h] if s in own else None
                out["schemes"][s][key] = scheme_figures(ref, scheme, prepared).to_json()
    finally:
        workspaces.put(ws)
    return out


def risk(layer: dict[str, Any], scheme: str) -> float:
    """A layer's risk under ``scheme``: the larger relative RMS weight error of W_UK and W_UV."""
    s = layer["schemes"][scheme]
    return max(s["w_uk"]["rel_rms"], s["w_uv"]["rel_rms"])


def _record(
    path: str | Path,
    model: Any,
    geo: Geometry,
    quant: Any,
    settings: Settings,
    explicit: Any,
    schemes: tuple[str, ...],
    layers: tuple[int, ...],
    note: str | None,
    records: list[dict[str, Any]],
    ckpt: RangeCheckpoint,
    start: float,
) -> dict[str, Any]:
    reader = ckpt.reader
    weights = sum(s.nbytes for k, s in ckpt.spans_read.items() if k.endswith(".weight"))
    rank_by = schemes[0]
    theory = {}
    for s in schemes:
        t = theory_for(s)
        theory[s] = None if t is None else {"weight": t.weight, "activation": t.activation, "bmm": t.product}
    return {
        "checkpoint": str(path),
        "model_type": model.model_type,
        "geometry": {
            "num_heads": geo.num_heads,
            "qk_nope_head_dim": geo.qk_nope_head_dim,
            "v_head_dim": geo.v_head_dim,
            "kv_lora_rank": geo.kv_lora_rank,
            "num_hidden_layers": model.num_hidden_layers,
            "num_nextn_predict_layers": model.num_nextn_predict_layers,
        },
        "quantization": quant.describe(),
        "settings": {
            **settings.to_json(),
            "quantization_config": None if explicit is None else explicit.to_json(),
        },
        "schemes": list(schemes),
        "rank_by": rank_by,
        "note": note,
        "io": {
            "bytes_read": reader.bytes_read,
            "kv_b_weight_bytes": weights,
            "scale_bytes": reader.tensor_bytes - weights,
            "header_bytes": reader.header_bytes,
            "files_read": len({s.file for s in ckpt.spans_read.values()}),
            "files_in_checkpoint": len(set(ckpt.weight_map.values())),
        },
        "seconds": round(time.perf_counter() - start, 3),
        "theory": theory,
        "layers": records,
        "ranking": sorted(layers, key=lambda i: -risk(records[layers.index(i)], rank_by)),
    }
