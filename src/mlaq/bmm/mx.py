"""MX BMM schemes: AMD's W4A4 MXFP4 kernel, MXFP4 weights with bf16 activations, and MXFP8.

Blocks of 32 run along K for weights and activations alike (the reduction axis, as the kernels'
``dot_scaled`` needs): W_UK is quantized along P, W_UV along L. MX dequantization is exact in fp32
(an element of <= 4 significant bits times a power of two), and so is every product of two MX
values (or of an MX value and a bf16 activation). The emulation sums them in float64 and rounds once
to fp32: the kernel's fp32 accumulation up to its order. Output rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight, check_operands, own_weight
from mlaq.formats import MxElem, MxTensor, ScaleRule, mx_fake_quant, quantize_mx

MX_BLOCK = 32


@dataclass(frozen=True, eq=False)
class MxWeight(PreparedWeight):
    """MX codes and E8M0 scales with blocks of 32 along K (``mx.axis == 1`` of (N, K, M))."""

    mx: MxTensor
    values: Tensor = field(repr=False)  # the dequantized weight, float64 (exact), cached at load

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return self.values.to(dtype)

    def storage_bytes(self) -> int:
        bits = 4 if self.mx.elem is MxElem.E2M1 else 8
        return self.mx.codes.numel() * bits // 8 + self.mx.scales.numel()


class _MxScheme(BmmScheme):
    out_dtype = torch.bfloat16
    compiles_exactly = True
    weight_elem: ClassVar[MxElem]
    weight_rule: ClassVar[ScaleRule]
    activation: ClassVar[tuple[MxElem, ScaleRule] | None]  # None: bf16 activations

    def prepare(self, weight: Tensor) -> PreparedWeight:
        if weight.dim() != 3 or min(weight.shape) < 1:
            raise ValueError(f"{self.name}: weight must be (N, K, M), got {tuple(weight.shape)}")
        if not torch.isfinite(weight).all():
            raise ValueError(f"{self.name}: weight holds NaN or inf; fix the checkpoint before quantizing it")
        # The engines quantize the bf16 weight (MXFP4 re-quantization needs a bf16 source).
        w = weight.detach().to(torch.bfloat16).float()
        mx = quantize_mx(w, self.weight_elem, self.weight_rule, axis=1, block_size=MX_BLOCK)
        return MxWeight(self.name, tuple(weight.shape), mx, mx.dequantize().double())

    def prepare_quantized(self, mx: MxTensor) -> PreparedWeight:
        """Use checkpoint codes + E8M0 scales as they are (e.g. a Quark MXFP4 weight wrapped with
        ``MxTensor.from_packed``). The blocks must run along K (axis 1 of (N, K, M))."""
        if len(mx.shape) != 3 or mx.axis % 3 != 1 or mx.block_size != MX_BLOCK:
            raise ValueError(
                f"{self.name}: need an (N, K, M) MX tensor with blocks of {MX_BLOCK} along K (axis 1), got "
                f"shape {mx.shape}, axis {mx.axis}, block {mx.block_size}; blocks along M cannot be used by a "
                "K-blocked kernel: dequantize and prepare() instead"
            )
        if mx.elem is not self.weight_elem:
            raise ValueError(f"{self.name}: needs {self.weight_elem.name} elements, got {mx.elem.name}")
        values = mx.dequantize()
        if not torch.isfinite(values).all():
            raise ValueError(f"{self.name}: the MX weight dequantizes to non-finite values (0xFF scales)")
        return MxWeight(self.name, mx.shape, mx, values.double())  # type: ignore[arg-type]

    def activation_values(self, x: Tensor) -> Tensor:
        return self._activations(x).double()

    def _activations(self, x: Tensor) -> Tensor:
        xb = x.to(torch.bfloat16).float()  # the kernels read bf16 activations
        if self.activation is None:
            return xb
        elem, rule = self.activation
        return mx_fake_quant(xb, elem, rule, axis=-1, block_size=MX_BLOCK)  # per token per 32 along K

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        w = own_weight(self, prepared, MxWeight)
        acc = torch.bmm(self._activations(x).double(), w.values).float()  # exact sum -> fp32
        return acc.to(torch.bfloat16).float()


class Mxfp4(_MxScheme):
    name = "mxfp4"
    weight_elem, weight_rule = MxElem.E2M1, ScaleRule.EVEN
    activation = (MxElem.E2M1, ScaleRule.EVEN)
    description = (
        "AMD W4A4 MXFP4 BMM: E2M1 weights with E8M0 scales (EVEN rule) per 32 along K, activations "
        "dynamically quantized to MXFP4 (EVEN) per token per 32 along K, exact products accumulated "
        "in fp32, bf16 output"
    )


class Mxfp4W4A16(_MxScheme):
    name = "mxfp4_w4a16"
    weight_elem, weight_rule = MxElem.E2M1, ScaleRule.EVEN
    activation = None
    description = (
        "MXFP4 weights only: E2M1 weights with E8M0 scales (EVEN rule) per 32 along K, bf16 "
        "activations, exact products accumulated in fp32, bf16 output"
    )


class Mxfp8(_MxScheme):
    name = "mxfp8"
    compiles_exactly = False  # inductor's C++ build of its emulation fails (torch 2.13)
    weight_elem, weight_rule = MxElem.E4M3, ScaleRule.RCEIL
    activation = (MxElem.E4M3, ScaleRule.RCEIL)
    description = (
        "MXFP8: E4M3 weights and per-token activations with E8M0 scales (RCEIL rule, as NVIDIA) "
        "per 32 along K, exact products accumulated in fp32, bf16 output"
    )
