"""``measure_stream``: validate's teacher-forced measurements, layer-major over a checkpoint read one
layer (and, inside an MoE layer, one routed expert) at a time.

Order of work: plan the memory; embed every window for every stream (only the embedding rows the
windows use are read); per main layer: read it in every compute dtype, prepare each variant's BMMs,
run every stream's attention (replaying the reference's input under each variant), then the MLP, each
routed expert read once for all streams, release; then the final norm and head (KL / top-1 / ΔNLL per
position chunk); then the MTP layer(s) on the reference's hidden states, replayed like the main ones.
No free generation runs in this mode (it needs every layer per token): the record says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mlaq.bmm import get_scheme
from mlaq.bmm.tp import shard_heads
from mlaq.libc import return_freed_memory
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.model.layers.rope import RopeTable
from mlaq.model.layers.step import step_positions
from mlaq.model.loading.kv_b import apply_decision
from mlaq.model.loading.layer_source import LayerSource, StreamedLayer
from mlaq.policy import decide_from_dir
from mlaq.validate.config import NOISE_FLOOR, REFERENCE, ValidateConfig, Variant, VariantKind
from mlaq.validate.inputs import local_inputs
from mlaq.validate.metrics import Buckets
from mlaq.validate.progress import NullProgress, Progress
from mlaq.validate.stream.budget import Plan, StreamConfig, current_rss, peak_rss, plan, reads
from mlaq.validate.stream.mtp import mtp_stage
from mlaq.validate.stream.sizes import shape_and_sizes
from mlaq.validate.stream.stages import embedded, head_stage, mlp_stage
from mlaq.validate.stream.streams import Stream, attention_stage
from mlaq.validate.stream.tasks import TaskStreams, task_shape
from mlaq.validate.tasks.run import Drawn
from mlaq.validate.text import EvalData


@dataclass(frozen=True)
class LayerStat:
    """Where one layer's time went (-1: the final norm and head). ``read_seconds`` is the I/O share of
    ``weights_seconds`` + ``expert_seconds`` (reading, dequantizing and casting weights)."""

    layer: int
    seconds: float
    bytes_read: int
    experts_read: int
    read_seconds: float = 0.0
    weights_seconds: float = 0.0  # the layer's non-expert weights
    attention_seconds: float = 0.0  # every stream's attention and the per-layer replays
    mlp_seconds: float = 0.0  # the MLP / MoE of every stream, routed-expert reading included
    expert_seconds: float = 0.0  # reading and preparing routed experts
    peak_rss: int = 0  # the process's peak resident set at the end of this layer


@dataclass
class StreamMeasurement:
    """The raw material of a streamed report: one Stream per variant, reference first."""

    config: ValidateConfig
    data: EvalData
    buckets: Buckets
    source: LayerSource
    streams: list[Stream]  # reference, noise floor (if any), candidates in report order
    noise_floor: bool
    operands: dict[int, dict[str, float]]
    decisions: list[dict[str, Any]]
    plan: Plan
    tasks: TaskStreams | None = None  # the long-context suite's samples, scored at the head
    drawn: Drawn | None = None
    layer_stats: list[LayerStat] = field(default_factory=list)
    bytes_read: int = 0
    peak_rss: int = 0
    timings: dict[str, float] = field(default_factory=dict)


def measure_stream(
    config: ValidateConfig,
    stream: StreamConfig,
    *,
    reference: Variant = REFERENCE,
    noise_floor: Variant | None = NOISE_FLOOR,
    progress: Progress | None = None,
) -> StreamMeasurement:
    """Measure every candidate (and the noise floor) against ``reference`` within the memory budget;
    each progress step names the bytes read, an ETA from them, and the peak RSS."""
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    return_freed_memory()
    source = LayerSource(config.model, load_mtp=None)
    cfg = source.config
    policy = None
    if config.as_configured:  # a bad --quantization-config fails now, before any layer is read
        policy = decide_from_dir(config.model, config.settings, config.policy_config(), log=False)
        if any(d.online is not None for d in policy.layers):
            raise ValueError(
                "--stream: vLLM's meaning of targets (--quantization online, or --engine-defaults vllm-0.32 with "
                "targets) quantizes the kv_b_proj linear, which the streamed layers share between variants and do "
                "not run online; validate it without --stream"
            )
    context = config.resolve_context(cfg.max_position_embeddings)
    inputs = local_inputs(config, context, cfg.max_position_embeddings)
    data, buckets, drawn = inputs.data, inputs.buckets, inputs.drawn
    variants = [reference, *([noise_floor] if noise_floor else []), *config.variants(reference)]
    dtypes = list(dict.fromkeys(v.dtype for v in variants))
    windows = data.windows()
    task_variants = [reference, *config.variants(reference)]  # as the engine: no fp32 noise floor
    shape, sizes = shape_and_sizes(
        source, variants, len(windows), context, task_shape(drawn, task_variants, config.precision)
    )
    the_plan = plan(
        shape, stream.memory_budget, current_rss(), sizes.layer, sizes.expert, sizes.head, stream.max_chunk
    )
    ids = torch.cat(windows)  # (W, T)
    streams = _embed(source, variants, windows, ids, buckets)
    ref, others = streams[0], streams[1:]
    rope = RopeTable(source.mla_config.rope)
    step = step_positions((0,), context, rope)
    tasks = None
    if drawn is not None:
        task_dtypes = list(dict.fromkeys(v.dtype for v in task_variants))
        tasks = TaskStreams(
            drawn.samples,
            task_variants,
            config.precision,
            drawn.suite.batch_tokens,
            rope,
            lambda task_ids: embedded(source, task_ids, task_dtypes),
        )
    operands: dict[int, dict[str, float]] = {}
    out = StreamMeasurement(
        config, data, buckets, source, streams, noise_floor is not None, operands, [], the_plan
    )
    out.tasks, out.drawn = tasks, drawn
    task_seconds = 0.0
    if policy is not None:
        out.decisions = [d.to_json() for d in policy.layers]
    n_main = cfg.num_hidden_layers
    progress.begin(n_main * (3 + (tasks is not None)) + 1 + source.num_mtp_layers)
    begun = time.perf_counter()

    def announce(what: str) -> None:
        progress.step(f"{what} ({reads(source.bytes_read, sizes.total_read, time.perf_counter() - begun)})")

    ok = False
    try:
        for i in range(n_main):
            start, read0, io0 = time.perf_counter(), source.bytes_read, source.reader.seconds_reading
            announce(f"layer {i}: reading")
            layer = source.layer(i, dtypes)
            t_weights = time.perf_counter()
            prepare = _preparer(layer, policy, config)
            announce(f"layer {i}: attention")
            attention_stage(
                i,
                False,
                layer.modules,
                prepare,
                ref,
                others,
                step,
                the_plan.chunk,
                operands,
                flip_rows=config.flip_rows,
            )
            if tasks is not None:
                announce(f"layer {i}: task samples")
                t_tasks = time.perf_counter()
                tasks.attention(layer.modules, prepare, the_plan.chunk)
                task_seconds += time.perf_counter() - t_tasks
            t_attn = time.perf_counter()
            announce(f"layer {i}: MLP")
            clock = [0.0]
            extra = [] if tasks is None else tasks.hidden(prefixes=i < n_main - 1)
            experts = mlp_stage(source, i, layer.modules, streams, clock, extra)
            del layer, prepare
            end = time.perf_counter()
            _stat(
                out,
                LayerStat(
                    i,
                    end - start,
                    source.bytes_read - read0,
                    experts,
                    source.reader.seconds_reading - io0,
                    t_weights - start,
                    t_attn - t_weights,
                    end - t_attn,
                    clock[0],
                ),
            )
        announce("final norm and head: KL, top-1, ΔNLL")
        start, read0, io0 = time.perf_counter(), source.bytes_read, source.reader.seconds_reading
        final = head_stage(source, streams, ids, dtypes, the_plan.head_chunk, tasks)
        _stat(
            out,
            LayerStat(
                -1,
                time.perf_counter() - start,
                source.bytes_read - read0,
                0,
                source.reader.seconds_reading - io0,
            ),
        )
        for j in range(source.num_mtp_layers):
            i = n_main + j
            shift = j + 1
            if context <= shift:
                break
            start, read0, io0 = time.perf_counter(), source.bytes_read, source.reader.seconds_reading
            announce(f"MTP layer {i}")
            final, experts = mtp_stage(
                source,
                i,
                shift,
                final,
                ids,
                lambda layer: _preparer(layer, policy, config),
                streams,
                operands,
                the_plan.chunk,
                lambda index, modules, ss: mlp_stage(source, index, modules, ss),
                config.flip_rows,
            )
            _stat(
                out,
                LayerStat(
                    i,
                    time.perf_counter() - start,
                    source.bytes_read - read0,
                    experts,
                    source.reader.seconds_reading - io0,
                ),
            )
        ok = True
    finally:
        progress.end(ok)
    out.bytes_read = source.bytes_read
    out.peak_rss = peak_rss()
    out.timings = {"total": time.perf_counter() - t0}
    if tasks is not None:
        out.timings["tasks"] = task_seconds
    return out


def _stat(out: StreamMeasurement, stat: LayerStat) -> None:
    out.layer_stats.append(dataclasses.replace(stat, peak_rss=peak_rss()))


def _embed(
    source: LayerSource, variants: Sequence[Variant], windows: list[Tensor], ids: Tensor, buckets: Buckets
) -> list[Stream]:
    rows, remapped = source.embedding_rows("model.embed_tokens.weight", ids)
    streams = []
    for v in variants:
        table = rows.to(v.dtype)
        embedded = [table[remapped[w : w + 1]] for w in range(len(windows))]  # (1, T, H) each
        streams.append(Stream.start(v, embedded, buckets))
    return streams


def _preparer(layer: StreamedLayer, policy, config: ValidateConfig) -> Callable[[Variant], AbsorbedWeights]:
    """Prepares a variant's absorbed BMM weights for this layer, as the in-memory pool does."""

    def prepare(v: Variant) -> AbsorbedWeights:
        attn = layer.modules[v.dtype].self_attn
        if v.kind is VariantKind.AS_CONFIGURED:
            apply_decision(
                attn, policy.for_layer(layer.index), layer.kv_b, config.precision, config.tensor_parallel_size
            )
        else:
            attn.prepare(shard_heads(get_scheme(v.scheme), config.tensor_parallel_size), config.precision)
        assert attn.absorbed is not None
        return attn.absorbed

    return prepare
