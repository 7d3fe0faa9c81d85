"""The in-memory engine source's teacher-forced windows: the reference capture, then every variant's
whole-window stream (KL, top-1, NLL change by position), each layer's attention replayed on the
captured inputs (relative error by layer and position), the attention flips, and on the first window
the per-op error of both BMMs (the exact products computed once per layer, shared by every scheme).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mlaq.model import ModelCache
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.validate.capture import (
    LayerInput,
    ProjectedInput,
    attention_output,
    capture_reference,
    project_input,
)
from mlaq.validate.config import Variant, VariantKind
from mlaq.validate.flips import FlipReference, add_flips, attention_flips, flip_reference
from mlaq.validate.metrics import Buckets, BucketSums, PositionDivergence, divergence, relative_error_terms
from mlaq.validate.progress import Progress
from mlaq.validate.record import GenerationRecord, OpRecord, TaskScoreRecord, VariantRecord
from mlaq.validate.sources import common
from mlaq.validate.theory import exact, op_errors, operand_stats
from mlaq.validate.variants import ModelPool, scheme_descriptions


@dataclass
class Run:
    """What is being measured for one variant (mutable while the source runs)."""

    variant: Variant
    windows: list[BucketSums] = field(default_factory=list)
    layers: dict[int, bool] = field(default_factory=dict)  # layer -> is MTP
    ops: list[OpRecord] = field(default_factory=list)
    generation: GenerationRecord | None = None
    descriptions: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    per_token: dict[str, list[list[float]]] = field(default_factory=dict)
    tasks: list[TaskScoreRecord] = field(default_factory=list)

    def freeze(self, decisions: list[dict]) -> VariantRecord:
        v = self.variant
        return VariantRecord(
            **common.variant_fields(v, self.descriptions, self.windows, self.layers),
            ops=list(self.ops),
            generation=self.generation,
            decisions=decisions if v.kind is VariantKind.AS_CONFIGURED else [],
            seconds=self.seconds,
            per_token=dict(self.per_token),
            tasks=list(self.tasks),
        )


def teacher_forced(
    pool: ModelPool,
    runs: dict[Variant, Run],
    reference: Variant,
    others: Sequence[Variant],
    windows: Sequence[torch.Tensor],
    buckets: Buckets,
    progress: Progress,
    flip_rows: int = 0,
) -> dict[int, dict[str, float]]:
    """Per window: capture under the reference, then every variant teacher-forced and per layer (with
    the attention flips on ``flip_rows`` sampled query rows, for variants in the reference's dtype).
    Returns the first window's operand statistics per layer."""
    operands: dict[int, dict[str, float]] = {}
    ref_run = runs[reference]
    ref_abs: dict[int, AbsorbedWeights] = {}
    for w, ids in enumerate(windows):
        progress.step(f"reference capture, window {w + 1}/{len(windows)}")
        start = time.perf_counter()
        ref_model = pool.model(reference)
        window = capture_reference(ref_model, ids)
        logprobs, layers = window.logprobs, window.layers
        del window
        nll = -logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]  # (T-1,)
        ref_run.windows.append(sums := BucketSums(buckets))
        sums.add("nll", torch.arange(nll.shape[0]), nll)
        if w == 0:  # per-op figures on the first window (the reference's weights are snapshotted)
            ref_abs = _absorbed(ref_model, layers)
            ref_run.seconds += time.perf_counter() - start
            operands = _per_op(pool, runs, reference, others, layers, ref_abs)  # times each variant's part
            start = time.perf_counter()
            ref_model = pool.model(reference)  # the per-op figures re-prepared the shared model
        # the BMM inputs are read by the per-op figures only: free them before the long part
        layers = tuple(dataclasses.replace(inp, bmm_inputs=None) for inp in layers)
        flip_refs = (
            [flip_reference(ref_model, inp, ref_abs[inp.layer], flip_rows) for inp in layers]
            if flip_rows
            else []
        )
        ref_run.seconds += time.perf_counter() - start
        projected: dict[tuple[int, int], ProjectedInput] = {}  # (id(model), layer) -> projected input
        for v in others:
            progress.step(f"{v.name}: teacher-forced window {w + 1}/{len(windows)}, per-layer attention")
            start = time.perf_counter()
            model = pool.model(v)
            runs[v].windows.append(sums := BucketSums(buckets))
            # the first layer's input in this stream IS its captured input when the model is the
            # reference's (same weights, only the BMMs re-prepared): its replay is the stream's output
            first = layers[0].layer if model is ref_model else None
            logits, first_out = _teacher_forced_logits(model, ids, first)  # (T, V), (T, H) | None
            d = _add_divergence(sums, logprobs, logits, ids[0, 1:])
            for name, values in common.per_token_values(d).items():
                runs[v].per_token.setdefault(name, []).append(values)
            del logits, d
            outputs = {} if first is None else {first: first_out}
            for inp in layers:
                if inp.layer not in outputs:  # the projections do not depend on the scheme: once per model
                    key = (id(model), inp.layer)
                    if key not in projected:
                        projected[key] = project_input(model, inp)
                    outputs[inp.layer] = attention_output(model, inp, projected[key])
            _add_layer_errors(runs[v], sums, layers, outputs)
            del outputs
            if v.dtype == reference.dtype:
                _add_flips(sums, model, flip_refs)
            runs[v].seconds += time.perf_counter() - start
        del projected, flip_refs, logprobs, layers
    return operands


def _per_op(
    pool: ModelPool,
    runs: dict[Variant, Run],
    reference: Variant,
    others: Sequence[Variant],
    layers: Sequence[LayerInput],
    ref_abs: dict[int, AbsorbedWeights],
) -> dict[int, dict[str, float]]:
    """The per-op errors of every variant's BMMs on the first window, against the exact products
    computed once per layer and shared by every variant (float64: 0.3 GiB per layer at 16,384 tokens,
    so one layer's at a time). Returns the operand statistics per layer."""
    ref_run = runs[reference]
    operands: dict[int, dict[str, float]] = {}
    abs_of: dict[Variant, dict[int, AbsorbedWeights]] = {}
    for v in others:  # each variant's prepared weights, immutable: one switch of the shared model each
        start = time.perf_counter()
        abs_of[v] = _absorbed(pool.model(v), layers)
        runs[v].ops = []
        runs[v].seconds += time.perf_counter() - start
    for inp in layers:
        start = time.perf_counter()
        e = exact(ref_abs[inp.layer], inp)
        operands[inp.layer] = operand_stats(ref_abs[inp.layer], inp, e)
        ref_run.ops.append(_op(op_errors(ref_abs[inp.layer], ref_abs[inp.layer], inp, e)))
        ref_run.seconds += time.perf_counter() - start
        for v in others:
            start = time.perf_counter()
            runs[v].ops.append(_op(op_errors(abs_of[v][inp.layer], ref_abs[inp.layer], inp, e)))
            runs[v].seconds += time.perf_counter() - start
        del e
    ref_run.descriptions = scheme_descriptions(pool.model(reference))
    for v in others:
        runs[v].descriptions = scheme_descriptions(pool.model(v))
    return operands


def _teacher_forced_logits(
    model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The whole window (1, T) through the absorbed (decode) path -> logits (T, V), and layer
    ``keep``'s attention output (o_proj's, (T, H) float32) when asked for."""
    kept: list[torch.Tensor] = []
    hook = None
    if keep is not None:
        o_proj = model.model.layers[keep].self_attn.o_proj
        hook = o_proj.register_forward_hook(lambda _m, _args, out: kept.append(out[0].float()))
    try:
        logits = model(ids, ModelCache(), path=AttnPath.ABSORBED).logits[0]
    finally:
        if hook is not None:
            hook.remove()
    return logits, kept[0] if kept else None


def _op(o) -> OpRecord:  # theory.OpError -> the record's plain copy
    return OpRecord(o.layer, o.weight_uk, o.weight_uv, o.act_uk, o.act_uv, o.bmm_uk, o.bmm_uv)


def _add_divergence(
    sums: BucketSums, ref_logprobs: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
) -> PositionDivergence:
    d = divergence(ref_logprobs, logits, targets)
    positions = torch.arange(ref_logprobs.shape[0])
    sums.add("kl", positions, d.kl)
    sums.add("top1", positions, d.top1)
    sums.add("nll_delta", positions[:-1], d.nll_delta)
    return d


def _add_layer_errors(
    run: Run, sums: BucketSums, layers: Sequence[LayerInput], outputs: dict[int, torch.Tensor]
) -> None:
    """Each layer's attention output under the variant (``outputs``, (T', H) each) against the reference."""
    for inp in layers:
        diff2, ref2 = relative_error_terms(outputs[inp.layer], inp.ref_out)  # (T',) each
        sums.add(f"attn_diff2/{inp.layer}", inp.positions[0], diff2)
        sums.add(f"attn_ref2/{inp.layer}", inp.positions[0], ref2)
        run.layers[inp.layer] = inp.mtp


def _add_flips(sums: BucketSums, model: torch.nn.Module, refs: Sequence[FlipReference]) -> None:
    for ref in refs:
        add_flips(sums, ref.layer, attention_flips(model, ref))


def _absorbed(model: torch.nn.Module, layers: Sequence[LayerInput]) -> dict[int, AbsorbedWeights]:
    """Each layer's prepared BMM weights now (immutable: safe to keep across re-preparation)."""
    out = {}
    for inp in layers:
        ab = model.model.layers[inp.layer].self_attn.absorbed
        assert ab is not None
        out[inp.layer] = ab
    return out
