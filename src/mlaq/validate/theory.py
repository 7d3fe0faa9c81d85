"""Per-op error of the absorbed BMMs, measured on the model's own weights and activations, against theory.

Theory (``formats.md``, relative RMS error of one quantization of N(0,1) data): MXFP4 (EVEN scale
rule) 11.19 %, MXFP8 E4M3 (RCEIL) 2.65 %, FP8 E4M3 per-tensor 2.65 %, per 1x128 group 2.57 %. A
product of two independently quantized operands has relative error about sqrt(e_w^2 + e_a^2), so a
W4A4 MXFP4 BMM sits near 15.8 %, a W8A8 FP8 one near 3.7 %. Real weights and activations are not
Gaussian (outlier heads, heavy tails, few 32-blocks per row), so the measured figures depart; the
report shows both, with the excess kurtosis that usually explains the gap.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme
from mlaq.model.mla_core import AbsorbedWeights
from mlaq.validate.capture import LayerInput
from mlaq.validate.metrics import relative_error

MXFP4_EVEN = 0.1119
MXFP8_RCEIL = 0.0265
FP8_PER_TENSOR = 0.0265
FP8_GROUP_1X128 = 0.0257
BF16_OUT = 0.0017  # rounding N(0,1) data to bf16 (RNE, 8 significant bits), measured relative RMS


@dataclass(frozen=True)
class Theory:
    weight: float  # relative RMS error of the weight quantization on Gaussian data
    activation: float  # ... of the dynamic activation quantization (0: bf16 activations)
    note: str
    output: float = BF16_OUT  # rounding of the BMM output (bf16 for every engine kernel)

    @property
    def product(self) -> float:
        """Expected relative error of one BMM output: independent errors add in quadrature."""
        return math.sqrt(self.weight**2 + self.activation**2 + self.output**2)

    def aligned(self, gain: float) -> float:
        """The same for operands with alignment gain ``gain`` (see :func:`alignment_gain`): the
        operand errors shrink by sqrt(gain) relative to the output, its own rounding does not."""
        return math.sqrt((self.weight**2 + self.activation**2) / gain + self.output**2)


THEORY: dict[str, Theory] = {
    "bf16": Theory(0.0, 0.0, "bf16 output rounding only"),
    "fp32": Theory(0.0, 0.0, "exact up to fp32 rounding", output=0.0),
    "fp8_per_tensor": Theory(FP8_PER_TENSOR, FP8_GROUP_1X128, "e4m3 per-tensor W, 1x128 A"),
    "fp8_per_head": Theory(FP8_PER_TENSOR, FP8_GROUP_1X128, "e4m3 per-head W, 1x128 A"),
    "fp8_per_channel": Theory(FP8_PER_TENSOR, FP8_GROUP_1X128, "e4m3 per-channel W, 1x128 A"),
    "fp8_per_block": Theory(FP8_GROUP_1X128, FP8_GROUP_1X128, "e4m3 128x128-block W, 1x128 A"),
    "mxfp4": Theory(MXFP4_EVEN, MXFP4_EVEN, "W4A4: MXFP4 weights and activations"),
    "mxfp4_w4a16": Theory(MXFP4_EVEN, 0.0, "MXFP4 weights, bf16 activations"),
    "mxfp8": Theory(MXFP8_RCEIL, MXFP8_RCEIL, "MXFP8 weights and activations"),
}


def theory_for(scheme: str) -> Theory | None:
    """Theory of a scheme name (``_fnuz`` variants share their e4m3fn figures); None if unknown."""
    return THEORY.get(scheme.removesuffix("_fnuz"))


def excess_kurtosis(x: Tensor) -> float:
    """E[(x - mean)^4] / var^2 - 3: 0 for a Gaussian, large for heavy tails and outliers."""
    v = x.double().reshape(-1)
    c = v - v.mean()
    var = float((c**2).mean())
    return float((c**4).mean()) / var**2 - 3.0 if var > 0 else 0.0


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


def _act_error(scheme: BmmScheme, x: Tensor) -> float | None:
    try:
        return relative_error(scheme.activation_values(x), x.double())
    except NotImplementedError:
        return None


@torch.no_grad()
def op_errors(ab: AbsorbedWeights, ref: AbsorbedWeights, inp: LayerInput) -> OpError:
    """Errors of the BMM weights ``ab``; exact = ``ref``'s weights (float64) times the recorded inputs."""
    w_uk, w_uv = ref.w_uk.dequantize(torch.float64), ref.w_uv.dequantize(torch.float64)  # exact
    x_uk, x_uv = inp.bmm_inputs  # (N, T, P), (N, T, L)
    return OpError(
        inp.layer,
        relative_error(ab.w_uk.dequantize(torch.float64), w_uk),
        relative_error(ab.w_uv.dequantize(torch.float64), w_uv),
        _act_error(ab.scheme_uk, x_uk),
        _act_error(ab.scheme_uv, x_uv),
        relative_error(ab.scheme_uk.apply(x_uk, ab.w_uk), torch.bmm(x_uk.double(), w_uk)),
        relative_error(ab.scheme_uv.apply(x_uv, ab.w_uv), torch.bmm(x_uv.double(), w_uv)),
    )


def alignment_gain(x: Tensor, w: Tensor) -> float:
    """|x @ w|^2 / sum_k x_k^2 w_k^2 summed over outputs: 1 when the K products have random signs (the
    theory's case), larger when activations line up with the weights (trained layers). Quantization
    errors stay incoherent, so the output's relative error shrinks by about sqrt(gain)."""
    x64, w64 = x.double(), w.double()
    return float(torch.bmm(x64, w64).pow(2).sum() / torch.bmm(x64**2, w64**2).sum())


def operand_stats(ref: AbsorbedWeights, inp: LayerInput) -> dict[str, float]:
    """Excess kurtosis of one layer's reference weights and BMM activations, and the alignment gain of
    each BMM: what makes the measured per-op errors depart from the Gaussian theory."""
    w_uk, w_uv = ref.w_uk.dequantize(torch.float64), ref.w_uv.dequantize(torch.float64)
    x_uk, x_uv = inp.bmm_inputs
    return {
        "kurtosis_w_uk": excess_kurtosis(w_uk),
        "kurtosis_w_uv": excess_kurtosis(w_uv),
        "kurtosis_x_uk": excess_kurtosis(x_uk),
        "kurtosis_x_uv": excess_kurtosis(x_uv),
        "gain_uk": alignment_gain(x_uk, w_uk),
        "gain_uv": alignment_gain(x_uv, w_uv),
    }
