"""Per-layer statistics of one absorbed-BMM weight (W_UK or W_UV^T) and of what a scheme makes of it.

Every figure is exact over the whole weight (no sampling): relative RMS and max abs error of the
scheme's weight against the checkpoint's exact value, the share of MX blocks (32 along K) in which a
nonzero element flushes to zero or an element saturates at the element type's max, the per-head spread
of amax (one scale over all heads serves the quiet heads badly), the excess kurtosis, and the BMM
output error predicted for Gaussian activations (:mod:`mlaq.bmm.theory`, with this weight's measured
error in place of the Gaussian weight term).

This module states the figures plainly (the spec, and the path for a weight whose K is not a multiple
of the MX block); the audit computes them with :mod:`mlaq.audit.measure`, pinned to these bit for bit
by tests/test_audit_fast.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mlaq.bmm import MxWeight, PreparedWeight
from mlaq.bmm.theory import excess_kurtosis, theory_for
from mlaq.formats.scale_rules import e8m0_decode


@dataclass(frozen=True)
class WeightStats:
    """Scheme-independent figures of one (N, K, M) weight."""

    elements: int
    kurtosis: float  # excess kurtosis over all elements
    head_amax_min: float
    head_amax_median: float
    head_amax_max: float

    @property
    def head_amax_spread(self) -> float:
        """max / min of the per-head amax (inf when a head is all zero)."""
        return self.head_amax_max / self.head_amax_min if self.head_amax_min > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        spread = self.head_amax_spread
        return {**asdict(self), "head_amax_spread": spread if math.isfinite(spread) else None}


@dataclass(frozen=True)
class SchemeError:
    """One weight under one scheme, against the checkpoint's exact value."""

    rel_rms: float
    max_abs: float
    flushed: float  # share of the nonzero elements that become zero
    mx_flush_blocks: float | None  # MX schemes: share of 32-blocks with a nonzero element flushed to 0
    mx_saturate_blocks: float | None  # MX schemes: share of 32-blocks with an element above max * scale
    predicted_bmm: float | None  # relative BMM output error for N(0,1) activations (None: no theory)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def weight_stats(w: Tensor) -> WeightStats:
    """Figures of a (N, K, M) weight, exact fp32 values."""
    amax = w.abs().amax(dim=(1, 2)).double()  # (N,)
    return WeightStats(
        w.numel(),
        excess_kurtosis(w, torch.float32),
        float(amax.min()),
        float(amax.median()),
        float(amax.max()),
    )


@dataclass(frozen=True, eq=False)
class Reference:
    """One weight's exact value (N, K, M) and what every scheme's comparison needs of it, computed once."""

    values: Tensor  # fp32, contiguous
    norm: float
    zeros: int
    # MX (blocks of 32 along K) of the bf16 weight the MX schemes quantize: per-block amax and zero count
    block_amax: Tensor | None = None  # (N, G, 1, M)
    block_zeros: Tensor | None = None  # (N, G, M)

    @classmethod
    @torch.no_grad()
    def of(cls, w: Tensor, mx_block: int | None = 32) -> Reference:
        w = w.float().contiguous()
        norm, zeros = float(torch.linalg.vector_norm(w)), int(torch.count_nonzero(w == 0))
        if mx_block is None:
            return cls(w, norm, zeros)
        # the schemes quantize the bf16 weight; a stored MX weight is exact in bf16, so this is its source
        src = _blocks(w.to(torch.bfloat16).float(), mx_block)  # (N, G, 32, M)
        return cls(w, norm, zeros, src.abs().amax(dim=2, keepdim=True), torch.count_nonzero(src == 0, dim=2))


def _blocks(t: Tensor, b: int) -> Tensor:
    """(N, K, M) -> (N, G, b, M), the ragged tail zero-padded (zeros neither flush nor saturate)."""
    n, k, m = t.shape
    g = math.ceil(k / b)
    if g * b != k:
        t = F.pad(t, (0, 0, 0, g * b - k))
    return t.view(n, g, b, m)


@torch.no_grad()
def scheme_error(ref: Reference, prepared: PreparedWeight, scheme: str) -> SchemeError:
    """``prepared`` (the scheme's weight at load) against ``ref``, the checkpoint's exact value.

    fp32 arithmetic: the weight errors are >= 2^-9 relative where nonzero, so fp32's 2^-24 rounding of the
    difference and torch's cascaded fp32 sums move the figures by far less than their printed digits."""
    q = prepared.dequantize(torch.float32).contiguous()
    diff = q - ref.values
    rel = float(torch.linalg.vector_norm(diff)) / ref.norm if ref.norm > 0 else 0.0
    lo, hi = torch.aminmax(diff)
    del diff
    q_zero = q == 0
    # an element of ref that is 0 stays 0 under every scheme, so the new zeros are the flushed ones
    n_nonzero = ref.values.numel() - ref.zeros
    flushed = (int(torch.count_nonzero(q_zero)) - ref.zeros) / n_nonzero if n_nonzero else 0.0
    flush_blocks = saturate_blocks = None
    if isinstance(prepared, MxWeight) and prepared.mx.axis % 3 == 1 and ref.block_amax is not None:
        flush_blocks, saturate_blocks = _mx_blocks(ref, q_zero, prepared)
    theory = theory_for(scheme)
    predicted = None if theory is None else theory.with_weight_error(rel).product
    return SchemeError(rel, max(-float(lo), float(hi)), flushed, flush_blocks, saturate_blocks, predicted)


def _mx_blocks(ref: Reference, q_zero: Tensor, prepared: MxWeight) -> tuple[float, float]:
    """Shares of the K-blocks with a flushed element and with a saturated one."""
    mx = prepared.mx
    n, g, _, m = ref.block_amax.shape  # type: ignore[union-attr]
    if tuple(mx.scales.shape) != (n, g, m):  # the reference was blocked by another block size
        raise ValueError(f"{prepared.scheme}: MX blocks of {mx.block_size} do not match the reference's")
    scale = e8m0_decode(mx.scales).view(n, g, 1, m)  # (N, G, 1, M)
    saturated = ref.block_amax > mx.elem.max * scale  # (N, G, 1, M)
    # a block has a flushed element when q holds more zeros than the source did (source 0 -> q 0)
    flushed = torch.count_nonzero(_blocks(q_zero, mx.block_size), dim=2) > ref.block_zeros  # (N, G, M)
    blocks = flushed.numel()
    return int(torch.count_nonzero(flushed)) / blocks, int(torch.count_nonzero(saturated)) / blocks
