"""The mechanism: does the scheme's noise on the query.key scores move attention off the key that matters?

On validate's captured reference inputs (each layer's attention input under bf16, absorbed path), the
attention rows of a sample of query positions are computed twice — BMM #1 with the reference's W_UK and
with the variant's — over the same latent keys, and compared per (query, head) pair:
- top-key flip: the highest-weighted key differs (float32 weights before the kernel's rounding);
- total-variation distance: 0.5 * sum_k |p_variant(k) - p_reference(k)|;
- retrieval-like rows: those whose reference top key holds >= 50 % of the weight (a head that
  retrieves one token); their flip rate is the one a needle task depends on.
Each row is bucketed by the number of keys it competes over (its visible keys: position + 1, or the DSA
selection), so the figures read against context length. Only BMM #1 moves the weights; BMM #2's error
is in the attention output error validate reports beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.model.layers.mla import MLAttention
from mlaq.model.layers.mla_core import (
    AbsorbedWeights,
    absorbed_scores,
    assemble_keys,
    attention_mask,
)
from mlaq.model.layers.mla_latent import masked_softmax_
from mlaq.validate.capture import LayerInput
from mlaq.validate.metrics import BucketSums

RETRIEVAL_WEIGHT = 0.5  # a reference top key at least this heavy marks a retrieval-like row
DEFAULT_ROWS = 256  # query positions sampled per window and layer (evenly spaced, the last included)


@dataclass(frozen=True)
class FlipRows:
    """Per (head, sampled query) comparison of one layer's attention rows on one window."""

    keys: Tensor  # (R,) int64: keys each sampled query competes over
    flipped: Tensor  # (N, R) bool: top key differs
    tv: Tensor  # (N, R) float64 total-variation distance
    retrieval: Tensor  # (N, R) bool: the reference's top key holds >= RETRIEVAL_WEIGHT


def sample_rows(length: int, rows: int) -> Tensor:
    """``rows`` evenly spaced query indices in 0..length-1 (all of them when length <= rows)."""
    if length <= rows:
        return torch.arange(length)
    return torch.linspace(0, length - 1, rows).round().long().unique()


@dataclass(frozen=True)
class FlipReference:
    """One layer's sampled query rows on one window under the reference (shared by every variant)."""

    layer: int
    q_nope: Tensor  # (1, R, N, P)
    q_pe: Tensor  # (1, R, N, R')
    keys: Tensor  # (1, K, L+R') latent keys of the window
    mask: Tensor  # (1, R, K) bool
    scale: float
    top_weight: Tensor  # (N, R) float32: the reference's largest weight per row
    top_key: Tensor  # (N, R) int64
    weights: Tensor  # (N, R, K) float32


@torch.no_grad()
def flip_reference(
    model: torch.nn.Module, inp: LayerInput, reference: AbsorbedWeights, rows: int = DEFAULT_ROWS
) -> FlipReference:
    """Project the captured input of layer ``inp.layer`` (the query/key projections do not depend on the
    BMM scheme) and compute the reference's attention weights on ``rows`` sampled query rows."""
    attn = model.model.layers[inp.layer].self_attn
    r = sample_rows(inp.hidden.shape[1], rows)  # (R,)
    return reference_rows(attn, inp.layer, inp.hidden, inp.positions, inp.key_mask, reference, r)


@torch.no_grad()
def reference_rows(
    attn: MLAttention,
    layer: int,
    hidden: Tensor,
    positions: Tensor,
    key_mask: Tensor | None,
    reference: AbsorbedWeights,
    r: Tensor,
) -> FlipReference:
    """:func:`flip_reference` on the query rows ``r`` (R,) of layer ``layer``'s attention ``attn``, from
    its input ``hidden`` (1, T, H) at ``positions`` (1, T) with the DSA selection ``key_mask`` (1, T, K)
    (a layer-streamed run passes the sample a few rows at a time, to bound the (N, R, K) weights)."""
    proj = attn.project(hidden.to(attn.dtype), positions)
    keys, valid = assemble_keys(None, None, proj.latent, positions)  # (1, K, L+R), (1, K)
    rows_mask = None if key_mask is None else key_mask[:, r]
    mask = attention_mask(positions[:, r], valid, rows_mask)  # (1, R, K)
    q_nope, q_pe = proj.q_nope[:, r], proj.q_pe[:, r]  # (1, R, N, P), (1, R, N, R')
    weights = _weights(q_nope, q_pe, keys, mask, reference, attn.softmax_scale)  # (N, R, K)
    top = weights.max(-1)
    return FlipReference(
        layer, q_nope, q_pe, keys, mask, attn.softmax_scale, top.values, top.indices, weights
    )


@torch.no_grad()
def attention_flips(model: torch.nn.Module, ref: FlipReference) -> FlipRows:
    """Compare the attention weights under the model's current BMM #1 weights of layer ``ref.layer``
    with the reference's, on the same rows and keys."""
    variant = model.model.layers[ref.layer].self_attn.absorbed
    if variant is None:
        raise ValueError(f"layer {ref.layer}: absorbed BMM weights are not prepared")
    return compare(ref, variant)


@torch.no_grad()
def compare(ref: FlipReference, variant: AbsorbedWeights) -> FlipRows:
    """The reference's rows against the same rows under ``variant``'s BMM #1 weights."""
    # float32 weights, unrounded: bf16-rounded weights tie often in diffuse rows, and a tie broken
    # the other way is not a flip of the score order
    weights = _weights(ref.q_nope, ref.q_pe, ref.keys, ref.mask, variant, ref.scale)  # (N, R, K)
    flipped = weights.argmax(-1) != ref.top_key
    tv = 0.5 * (weights.double() - ref.weights.double()).abs().sum(-1)
    return FlipRows(ref.mask[0].sum(-1), flipped, tv, ref.top_weight >= RETRIEVAL_WEIGHT)


def add_flips(sums: BucketSums, layer: int, f: FlipRows) -> None:
    """Flip figures bucketed by the number of keys each row competes over (keys - 1 as a position)."""
    where = (f.keys - 1).expand_as(f.flipped)  # (N, R)
    sums.add(f"flip/{layer}", where, f.flipped.double())
    sums.add(f"tv/{layer}", where, f.tv)
    sums.add(f"flip_retrieval/{layer}", where[f.retrieval], f.flipped[f.retrieval].double())


def _weights(
    q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor, w: AbsorbedWeights, scale: float
) -> Tensor:
    return masked_softmax_(absorbed_scores(q_nope, q_pe, keys, w, scale), mask, torch.float32)[0]
