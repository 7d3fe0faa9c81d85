"""Per-layer statistics of one absorbed-BMM weight (W_UK or W_UV^T) and of what a scheme makes of it.

Every figure is exact over the whole weight (no sampling): relative RMS and max abs error of the
scheme's weight against the checkpoint's exact value, the share of MX blocks (32 along K) in which a
nonzero element flushes to zero or an element saturates at the element type's max, the per-head spread
of amax (one scale over all heads serves the quiet heads badly), the excess kurtosis, and the BMM
output error predicted for Gaussian activations (:mod:`mlaq.bmm.theory`, with this weight's measured
error in place of the Gaussian weight term).
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


@torch.no_grad()
def scheme_error(ref: Tensor, prepared: PreparedWeight, scheme: str) -> SchemeError:
    """``prepared`` (the scheme's weight at load) against ``ref`` (N, K, M), the checkpoint's exact value.

    fp32 arithmetic: the weight errors are >= 2^-9 relative where nonzero, so fp32's 2^-24 rounding of the
    difference and torch's cascaded fp32 sums move the figures by far less than their printed digits."""
    ref = ref.float().contiguous()
    q = prepared.dequantize(torch.float32).contiguous()
    diff = q - ref
    norm = float(torch.linalg.vector_norm(ref))
    rel = float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else 0.0
    lo, hi = torch.aminmax(diff)
    zeros_q, zeros_ref = int(torch.count_nonzero(q == 0)), int(torch.count_nonzero(ref == 0))
    # an element of ref that is 0 stays 0 under every scheme, so the new zeros are the flushed ones
    n_nonzero = ref.numel() - zeros_ref
    flushed = (zeros_q - zeros_ref) / n_nonzero if n_nonzero else 0.0
    flush_blocks = saturate_blocks = None
    if isinstance(prepared, MxWeight) and prepared.mx.axis % 3 == 1:
        flush_blocks, saturate_blocks = _mx_blocks(ref, q, prepared)
    theory = theory_for(scheme)
    predicted = None if theory is None else theory.with_weight_error(rel).product
    return SchemeError(rel, max(-float(lo), float(hi)), flushed, flush_blocks, saturate_blocks, predicted)


def _mx_blocks(ref: Tensor, q: Tensor, prepared: MxWeight) -> tuple[float, float]:
    """Shares of the K-blocks with a flushed element and with a saturated one."""
    mx = prepared.mx
    n, k, m = prepared.shape
    b = mx.block_size
    g = math.ceil(k / b)
    # the scheme quantizes the bf16 weight; a stored MX weight is exact in bf16, so this is its source
    src = ref.to(torch.bfloat16).float()
    if g * b != k:  # ragged tail: zeros neither flush nor saturate
        src, q = F.pad(src, (0, 0, 0, g * b - k)), F.pad(q, (0, 0, 0, g * b - k))
    src, q = src.view(n, g, b, m), q.view(n, g, b, m)  # (N, K, M) -> (N, G, 32, M)
    scale = e8m0_decode(mx.scales).view(n, g, 1, m)  # (N, G, 1, M)
    saturated = src.abs().amax(dim=2, keepdim=True) > mx.elem.max * scale  # (N, G, 1, M)
    flushed = ((q == 0) & (src != 0)).any(dim=2)  # (N, G, M)
    blocks = flushed.numel()
    return int(torch.count_nonzero(flushed)) / blocks, int(torch.count_nonzero(saturated)) / blocks
