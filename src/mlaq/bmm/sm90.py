"""Schemes as an NVIDIA Hopper GPU computes them, on its sm90 tensor cores (``mlaq.bmm.tensor_core``).

``bf16_sm90``: the bf16 reference as cuBLAS's bf16 batched GEMM runs it: one chain of 16-deep bf16
``wgmma`` steps over all of K from zero (fp32 accumulator, terms and sums truncated), bf16 output rounded
to nearest. ``bf16`` (exact sums, rounded once) differs from it in ~0.01 % of outputs on an H200.

``fp8_per_block_sm90``: fp8_per_block as DeepGEMM computes it on Hopper.

Same weights and activation codes as ``fp8_per_block`` (128x128 weight blocks, 1x128 activation groups);
what differs is the sum. Per 128-deep K-block the tensor cores chain four 32-deep ``wgmma`` steps into a
13-fraction-bit accumulator that starts at zero (``mlaq.bmm.tensor_core``), and the partial sum is then
promoted into an fp32 register, ``final = fma(scale_a * scale_b, partial, final)`` (DeepGEMM's
``final_accum += scale_0_0 * accum``, contracted to one FMA by nvcc); bf16 output, round to nearest.
``fp8_per_block`` assumes exact sums instead: on an H200 the two differ in about 4 % of the bf16
outputs, by about 2 % of the quantization error's norm (bench/fp8_hardware.py, bench/RESULTS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaq.bmm.base import Bf16Reference, DenseWeight, PreparedWeight, check_operands, own_weight
from mlaq.bmm.fp8 import Fp8PerBlock
from mlaq.bmm.tensor_core import fma_fp32, sm90_bf16_dot, sm90_fp8_dot
from mlaq.formats import Fp8Dtype


class Bf16Sm90(Bf16Reference):
    """The bf16 reference with Hopper's bf16 tensor-core sums (cuBLAS's batched GEMM)."""

    name = "bf16_sm90"
    compiles_exactly = False  # inductor's C++ build of its emulation fails (torch 2.13)
    description = (
        "bf16 weights and activations as cuBLAS runs them on Hopper (sm90): 16-deep bf16 tensor-core steps "
        "into an fp32 accumulator, terms aligned to 2^-25 of the largest and truncated, sums truncated to "
        "fp32, output rounded to bf16"
    )

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        w = own_weight(self, prepared, DenseWeight)
        return sm90_bf16_dot(x, w.weight).to(torch.bfloat16).float()


class Fp8PerBlockSm90(Fp8PerBlock):
    """fp8_per_block with Hopper's FP8 tensor-core sums and DeepGEMM's per-128 FMA promotion (e4m3fn)."""

    base_name = "fp8_per_block_sm90"
    compiles_exactly = False  # inductor's C++ build of its emulation fails (torch 2.13)
    arithmetic = (
        "DeepSeek-V3 block FP8 as DeepGEMM runs it on Hopper (sm90): {dtype} weight with one scale per "
        "128x128 block of (K, M) per head (amax/{max}), activations per token per 128 along K as "
        "DeepSeek-V3's act_quant does, per K-block code dot products on the FP8 tensor cores (32-deep steps "
        "into a 13-fraction-bit accumulator, truncating), promoted as fma(activation scale x weight scale, "
        "partial, fp32 sum), bf16 output"
    )

    def __init__(self, dtype: Fp8Dtype = Fp8Dtype.E4M3FN) -> None:
        if dtype is not Fp8Dtype.E4M3FN:
            raise ValueError("fp8_per_block_sm90 is NVIDIA Hopper arithmetic: e4m3fn only")
        super().__init__(dtype)

    def _accumulate(self, acc: Tensor, xq: Tensor, wq: Tensor, scale: Tensor) -> Tensor:
        """One K-segment: the tensor cores' partial sum, promoted with DeepGEMM's one FMA."""
        return fma_fp32(scale, sm90_fp8_dot(xq, wq), acc)
