"""Expected relative error of the absorbed BMMs on Gaussian data, per scheme.

Theory (``formats.md``, relative RMS error of one quantization of N(0,1) data): MXFP4 (EVEN scale
rule) 11.19 %, MXFP8 E4M3 (RCEIL) 2.65 %, FP8 E4M3 per-tensor 2.65 %, per 1x128 group 2.57 %. A
product of two independently quantized operands has relative error about sqrt(e_w^2 + e_a^2), so a
W4A4 MXFP4 BMM sits near 15.8 %, a W8A8 FP8 one near 3.7 %. Real weights and activations are not
Gaussian (outlier heads, heavy tails, few 32-blocks per row), so measured figures depart; reports
show the excess kurtosis that usually explains the gap.

Lives in ``bmm`` (not ``validate``) so that every front door — validate, audit — can use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

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
        """The same for operands with alignment gain ``gain`` (see ``alignment_gain`` in validate): the
        operand errors shrink by sqrt(gain) relative to the output, its own rounding does not."""
        return math.sqrt((self.weight**2 + self.activation**2) / gain + self.output**2)

    def with_weight_error(self, weight: float) -> Theory:
        """This scheme's activation and output terms around a weight error measured on real weights:
        the BMM output error expected for Gaussian activations times that weight."""
        return replace(self, weight=weight)


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
    """Theory of a scheme name; None if unknown. ``_fnuz`` variants share their e4m3fn figures, ``_sm90``
    ones their exact-sum scheme's: Hopper's truncating sums moved an H200's outputs by ~2 % (FP8) and
    1-3 % (bf16) of the quantization error's norm (bench/RESULTS.md), ~0.02 % in quadrature."""
    return THEORY.get(scheme.removesuffix("_fnuz").removesuffix("_sm90"))


def excess_kurtosis(x: Tensor, dtype: torch.dtype = torch.float64) -> float:
    """E[(x - mean)^4] / var^2 - 3: 0 for a Gaussian, large for heavy tails and outliers.

    ``dtype`` float32 halves the cost on large weights (mlaq audit) at ~1e-6 relative accuracy."""
    v = x.to(dtype).reshape(-1)
    c2 = (v - v.mean()).square_()
    var = float(c2.mean())
    return float(c2.square_().mean()) / var**2 - 3.0 if var > 0 else 0.0
