"""The streams of a layer-major run and what each measures.

One stream per variant (the reference, the noise floor, each candidate), each with its own hidden
states for every window, passed through layer i before layer i+1. Under the reference stream every
layer's attention input is captured and replayed under each other variant (validate's per-layer
error, isolated from the drift of earlier layers); on the first window the activations of both BMMs
are recorded for the per-op error against theory, as validate's capture does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.mla import MLAttention
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.model.layers.step import StepPositions
from mlaq.validate.capture import LayerInput, _Recording
from mlaq.validate.config import Variant
from mlaq.validate.flips import add_flips, compare, reference_rows, sample_rows
from mlaq.validate.metrics import Buckets, BucketSums, relative_error_terms
from mlaq.validate.stream.layer_exec import attention, replay
from mlaq.validate.theory import OpError, op_errors, operand_stats


@dataclass
class Stream:
    """One variant's state across layers and what it has measured so far."""

    variant: Variant
    x: list[Tensor]  # per window (1, T, H): the hidden state entering the next layer
    shared_mask: list[Tensor | None]  # per window: the last full DSA layer's selection (GLM-5 shared)
    sums: list[BucketSums]  # per window
    layers: dict[int, bool] = field(default_factory=dict)  # layer -> is MTP
    ops: list[OpError] = field(default_factory=list)
    descriptions: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @classmethod
    def start(cls, variant: Variant, embedded: list[Tensor], buckets: Buckets) -> Stream:
        n = len(embedded)
        return cls(variant, embedded, [None] * n, [BucketSums(buckets) for _ in range(n)])


def install(
    layer: DecoderLayer, ab: AbsorbedWeights, record: bool = False
) -> tuple[_Recording, _Recording] | None:
    """Give ``layer`` the prepared BMM weights ``ab``; with ``record``, through recording wrappers
    (returned) that keep the activations each BMM receives."""
    attn = layer.self_attn
    if not record:
        attn.set_absorbed(ab.w_uk, ab.w_uv, ab.scheme_uk, scheme_uv=ab.scheme_uv, precision=ab.precision)
        return None
    rec = _Recording(ab.scheme_uk), _Recording(ab.scheme_uv)
    attn.set_absorbed(ab.w_uk, ab.w_uv, rec[0], scheme_uv=rec[1], precision=ab.precision)
    return rec


def describe(ab: AbsorbedWeights, out: dict[str, str]) -> None:
    out[ab.scheme_uk.name] = ab.scheme_uk.description
    out[ab.scheme_uv.name] = ab.scheme_uv.description


@dataclass
class _Captured:
    """The reference's view of one window at one layer."""

    hidden: Tensor  # (1, T, H) input_layernorm output
    key_mask: Tensor | None  # (1, T, T) the DSA selection it used
    ref_out: Tensor  # (T, H) float32 attention output


@torch.no_grad()
def attention_stage(
    index: int,
    mtp: bool,
    modules: dict[torch.dtype, DecoderLayer],
    prepare: Callable[[Variant], AbsorbedWeights],
    ref: Stream,
    others: Sequence[Stream],
    step: StepPositions,
    chunk: int,
    operands: dict[int, dict[str, float]],
    *,
    run_others: bool = True,
    flip_rows: int = 0,
) -> None:
    """Every stream's attention (plus residual) at layer ``index``; the reference's input replayed under
    every other variant. The reference runs every window first (its inputs captured); then each other
    variant in turn, its BMM weights prepared (``prepare``) only while it runs, so one candidate's
    prepared weights are alive at a time. ``run_others=False`` (MTP layers): only the replays.
    ``flip_rows``: query rows per window for the attention flip rate (variants in the reference's
    dtype, as validate measures them), ``chunk`` rows at a time."""
    ref_mod = modules[ref.variant.dtype]
    ref_ab = prepare(ref.variant)
    captured: list[_Captured] = []
    inp = None
    for w in range(len(ref.x)):
        rec = install(ref_mod, ref_ab, record=w == 0)
        h = ref_mod.input_layernorm(ref.x[w])  # (1, T, H)
        res = attention(ref_mod, h, step, ref.shared_mask[w], chunk)
        ref_out = res.out[0].float()  # (T, H)
        if rec is not None:
            uk, uv = (torch.cat(r.inputs, dim=1) for r in rec)  # chunks along the token axis
            inp = LayerInput(index, mtp, h, step.positions, res.key_mask, ref_out, (uk, uv))
            operands[index] = operand_stats(ref_ab, inp)
            ref.ops.append(op_errors(ref_ab, ref_ab, inp))
            describe(ref_ab, ref.descriptions)
            install(ref_mod, ref_ab)
        ref.x[w] = ref.x[w] + res.out
        if res.key_mask is not None:
            ref.shared_mask[w] = res.key_mask
        captured.append(_Captured(h, res.key_mask, ref_out))
        del res
    for s in others:
        mod = modules[s.variant.dtype]
        ab = prepare(s.variant)
        install(mod, ab)
        for w, cap in enumerate(captured):
            out = replay(mod, cap.hidden, step.positions, cap.key_mask, chunk)
            diff2, ref2 = relative_error_terms(out, cap.ref_out)  # (T,) each
            s.sums[w].add(f"attn_diff2/{index}", step.positions[0], diff2)
            s.sums[w].add(f"attn_ref2/{index}", step.positions[0], ref2)
            s.layers[index] = mtp
            if flip_rows and s.variant.dtype == ref.variant.dtype:
                _flips(s.sums[w], mod.self_attn, index, cap, step.positions, (ref_ab, ab), flip_rows, chunk)
            if w == 0 and inp is not None:
                s.ops.append(op_errors(ab, ref_ab, inp))
                describe(ab, s.descriptions)
            if run_others:
                own = attention(mod, mod.input_layernorm(s.x[w]), step, s.shared_mask[w], chunk)
                s.x[w] = s.x[w] + own.out
                if own.key_mask is not None:
                    s.shared_mask[w] = own.key_mask
        install(mod, ref_ab)  # drops this variant's prepared weights before the next one's are built
        del ab


def _flips(
    sums: BucketSums,
    attn: MLAttention,
    index: int,
    cap: _Captured,
    positions: Tensor,
    weights: tuple[AbsorbedWeights, AbsorbedWeights],
    rows: int,
    chunk: int,
) -> None:
    """The flip figures of one window at one layer: the sampled query rows (validate's), ``chunk`` at a
    time, the reference's weights (``weights[0]``) against the variant's (``weights[1]``)."""
    r = sample_rows(cap.hidden.shape[1], rows)  # (R,)
    for a in range(0, len(r), chunk):
        ref = reference_rows(attn, index, cap.hidden, positions, cap.key_mask, weights[0], r[a : a + chunk])
        add_flips(sums, index, compare(ref, weights[1]))
