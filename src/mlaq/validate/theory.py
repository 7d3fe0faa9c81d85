"""Per-op error of the absorbed BMMs, measured on the model's own weights and activations, against theory.

The Gaussian theory itself (``Theory``, ``THEORY``, ``theory_for``, ``excess_kurtosis``) lives in
:mod:`mlaq.bmm.theory`, so that ``mlaq audit`` shares it without importing validate; it is re-exported
here for existing callers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme
from mlaq.bmm.theory import (  # noqa: F401  (re-exported for validate's callers)
    BF16_OUT,
    FP8_GROUP_1X128,
    FP8_PER_TENSOR,
    MXFP4_EVEN,
    MXFP8_RCEIL,
    THEORY,
    Theory,
    excess_kurtosis,
    theory_for,
)
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.validate.capture import LayerInput
from mlaq.validate.metrics import relative_error

# Query rows per layer the per-op figures read: evenly spaced over the window (every k-th token), so the
# float64 products and each scheme's emulated BMMs cost the same whatever the window's length. The
# figures are ratios of sums over rows: the sample estimates the window's (the fp8 per-tensor scheme's
# activation scale is then the sample's amax, as a decode batch's is its own tokens').
PER_OP_ROWS = 512


def op_inputs(inp: LayerInput) -> tuple[Tensor, Tensor]:
    """The recorded BMM inputs (N, T', P), (N, T', L) at the rows the per-op figures read."""
    assert inp.bmm_inputs is not None, "the BMM inputs were freed before the per-op figures"
    x_uk, x_uv = inp.bmm_inputs
    step = -(-x_uk.shape[1] // PER_OP_ROWS)  # ceil: at most PER_OP_ROWS rows
    return (x_uk, x_uv) if step == 1 else (x_uk[:, ::step], x_uv[:, ::step])


@dataclass(frozen=True)
class OpError:
    """One layer's two BMMs under a scheme, against the exact product of the reference weights and the
    reference's own activations: weight, activation and output relative errors."""

    layer: int
    weight_uk: float
    weight_uv: float
    act_uk: float | None  # the scheme's dynamic activation quantization (None: not exposed)
    act_uv: float | None
    bmm_uk: float  # BMM #1, q absorption
    bmm_uv: float  # BMM #2, V up-projection


@dataclass(frozen=True)
class Exact:
    """One layer's exact BMM products on one window: the reference's weights (float64) times the
    reference's own recorded activations. They do not depend on the scheme measured: computed once per
    layer (``exact``) and shared by every scheme's ``op_errors`` and by ``operand_stats``."""

    w_uk: Tensor  # (N, P, L) float64
    w_uv: Tensor  # (N, L, V) float64
    y_uk: Tensor  # (N, T, L) float64: x_uk @ w_uk
    y_uv: Tensor  # (N, T, V) float64
    norm_uk: Tensor  # 0-d float64: sum |y_uk|^2, summed as metrics.relative_error sums it
    norm_uv: Tensor


@torch.no_grad()
def exact(ref: AbsorbedWeights, inp: LayerInput) -> Exact:
    """The exact products of layer ``inp.layer``'s two BMMs under the reference weights ``ref``."""
    w_uk, w_uv = ref.w_uk.dequantize(torch.float64), ref.w_uv.dequantize(torch.float64)
    x_uk, x_uv = op_inputs(inp)  # (N, T, P), (N, T, L)
    y_uk, y_uv = torch.bmm(x_uk.double(), w_uk), torch.bmm(x_uv.double(), w_uv)
    return Exact(w_uk, w_uv, y_uk, y_uv, _norm(y_uk), _norm(y_uv))


def _norm(y: Tensor) -> Tensor:
    return (y**2).sum()  # a contiguous tensor's full sum: the same order as metrics.relative_error's


def _relative(out: Tensor, y: Tensor, norm: Tensor) -> float:
    """``metrics.relative_error(out, y)`` with the exact side's sum of squares given (same sums)."""
    return math.sqrt(float(((out.double() - y) ** 2).sum() / norm))


def _act_error(scheme: BmmScheme, x: Tensor) -> float | None:
    try:
        return relative_error(scheme.activation_values(x), x.double())
    except NotImplementedError:
        return None


@torch.no_grad()
def op_errors(
    ab: AbsorbedWeights, ref: AbsorbedWeights, inp: LayerInput, products: Exact | None = None
) -> OpError:
    """Errors of the BMM weights ``ab``; exact = ``ref``'s weights (float64) times the recorded inputs
    (``products``: those already computed by ``exact(ref, inp)``, shared across schemes)."""
    e = exact(ref, inp) if products is None else products
    x_uk, x_uv = op_inputs(inp)  # (N, T, P), (N, T, L)
    return OpError(
        inp.layer,
        relative_error(ab.w_uk.dequantize(torch.float64), e.w_uk),
        relative_error(ab.w_uv.dequantize(torch.float64), e.w_uv),
        _act_error(ab.scheme_uk, x_uk),
        _act_error(ab.scheme_uv, x_uv),
        _relative(ab.scheme_uk.apply(x_uk, ab.w_uk), e.y_uk, e.norm_uk),
        _relative(ab.scheme_uv.apply(x_uv, ab.w_uv), e.y_uv, e.norm_uv),
    )


def alignment_gain(x: Tensor, w: Tensor, product: Tensor | None = None) -> float:
    """|x @ w|^2 / sum_k x_k^2 w_k^2 summed over outputs: 1 when the K products have random signs (the
    theory's case), larger when activations line up with the weights (trained layers). Quantization
    errors stay incoherent, so the output's relative error shrinks by about sqrt(gain). ``product``:
    x @ w in float64, when already computed."""
    x64, w64 = x.double(), w.double()
    y = torch.bmm(x64, w64) if product is None else product
    return float(y.pow(2).sum() / torch.bmm(x64**2, w64**2).sum())


def operand_stats(ref: AbsorbedWeights, inp: LayerInput, products: Exact | None = None) -> dict[str, float]:
    """Excess kurtosis of one layer's reference weights and BMM activations, and the alignment gain of
    each BMM: what makes the measured per-op errors depart from the Gaussian theory."""
    e = exact(ref, inp) if products is None else products
    x_uk, x_uv = op_inputs(inp)
    return {
        "kurtosis_w_uk": excess_kurtosis(e.w_uk),
        "kurtosis_w_uv": excess_kurtosis(e.w_uv),
        "kurtosis_x_uk": excess_kurtosis(x_uk),
        "kurtosis_x_uv": excess_kurtosis(x_uv),
        "gain_uk": alignment_gain(x_uk, e.w_uk, e.y_uk),
        "gain_uv": alignment_gain(x_uv, e.w_uv, e.y_uv),
    }
