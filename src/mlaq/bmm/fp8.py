"""FP8 BMM schemes: the AMD/vLLM AITER kernel (one weight scale) and finer-grained variants.

Two kernel families are emulated, each with its own order of fp32 operations:

* AITER ``batched_gemm_a8w8_a_per_token_group_prequant_w_per_batched_tensor_quant`` (fp8_per_tensor,
  and fp8_per_head / fp8_per_channel: the same kernel with a finer weight scale in its epilogue):
  ``acc += dot(xq_g, wq_g) * a_scale_g`` over the 128-groups of K, then ``acc *= w_scale``, bf16 out.
  The epilogue scale cannot vary along K, so a checkpoint scale that does (W_UK of a per-channel
  kv_b_proj) only fits fp8_per_block's per-segment scaling.
* DeepSeek-V3 / DeepGEMM / TensorRT-LLM block scaling (fp8_per_block): 128x128 weight blocks and
  1x128 activation groups, ``acc += dot(xq_s, wq_s) * (a_scale_g * w_scale_s)`` per K-segment.

The code dot product of one K-group is exact in float64 (products of e4m3 codes lie on a 2^-18 grid
below 2^18: 128 of them sum within 44 bits), so the emulation forms it there and rounds once to
fp32 — the kernel's fp32 MFMA result up to its accumulation order. The scales are applied after it
in fp32, in the kernel's order (a code times an fp32 scale is not always representable in fp32,
so the weight is never pre-multiplied). Every scheme rounds its
activations to bf16 first (the kernels read bf16) and its output to bf16.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight, check_operands, own_weight
from mlaq.bmm.fp8_quant import (
    FP8_GROUP,
    aiter_token_group_quant,
    deepseek_token_group_quant,
    vllm_batched_tensor_quant,
)
from mlaq.formats import Fp8Dtype, quantize_fp8

_FP8_DTYPES = (Fp8Dtype.E4M3FN, Fp8Dtype.E4M3FNUZ)


@dataclass(frozen=True, eq=False)
class Fp8Weight(PreparedWeight):
    """FP8 codes (N, K, M) and fp32 dequant scales constant over K-segments: ``scale`` is
    (N or 1, S, M or 1), one row per segment [k_bounds[s], k_bounds[s+1]) of K."""

    codes: Tensor
    scale: Tensor
    k_bounds: tuple[int, ...]
    dtype: Fp8Dtype
    values: Tensor = field(repr=False)  # codes as float64 (exact), cached at load for the emulation
    m_block: int = 1  # columns that really share a scale (128 for 128x128 blocks; storage_bytes only)

    def expanded_scale(self) -> Tensor:
        """The scale of every element, fp32 (N, K, M)."""
        lengths = torch.tensor(
            [b - a for a, b in itertools.pairwise(self.k_bounds)], device=self.scale.device
        )
        return self.scale.repeat_interleave(lengths, dim=1).expand(self.shape)

    def storage_bytes(self) -> int:
        n, s, m = self.scale.shape
        return self.codes.numel() + 4 * n * s * -(-m // self.m_block)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        # code * scale needs <= 4 + 24 significant bits: exact in float64, rounded once to dtype.
        if dtype == torch.float32:  # one correctly rounded fp32 multiply is that same single rounding
            return self.codes.float() * self.expanded_scale()
        return (self.values * self.expanded_scale().double()).to(dtype)


def _make_weight(
    scheme: str, codes: Tensor, scale: Tensor, k_bounds: tuple[int, ...], dtype: Fp8Dtype, m_block: int = 1
) -> Fp8Weight:
    n, k, m = codes.shape
    scale = scale.float().contiguous()
    return Fp8Weight(scheme, (n, k, m), codes, scale, k_bounds, dtype, codes.double(), m_block)


class _Fp8Scheme(BmmScheme):
    """An FP8 scheme over e4m3fn (gfx950, NVIDIA) or e4m3fnuz (gfx942: name suffix ``_fnuz``)."""

    out_dtype = torch.bfloat16
    compiles_exactly = True
    base_name: ClassVar[str]
    arithmetic: ClassVar[str]  # description with {dtype} and {max} placeholders

    def __init__(self, dtype: Fp8Dtype = Fp8Dtype.E4M3FN) -> None:
        if dtype not in _FP8_DTYPES:
            raise ValueError(f"FP8 BMM schemes use e4m3fn or e4m3fnuz, got {dtype.name}")
        self.dtype = dtype
        self.name = self.base_name + ("_fnuz" if dtype is Fp8Dtype.E4M3FNUZ else "")
        self.description = self.arithmetic.format(dtype=dtype.value, max=f"{dtype.max:g}")

    def _weight(self, prepared: PreparedWeight) -> Fp8Weight:
        return own_weight(self, prepared, Fp8Weight)

    def _check_stored(self, codes: Tensor, scale: Tensor) -> None:
        """Checkpoint codes (N, K, M) in this scheme's fp8 dtype and a finite, non-negative float scale."""
        if codes.dim() != 3 or codes.dtype != self.dtype.torch_dtype:
            hint = (
                " (convert e4m3fn checkpoints with mlaq.formats.e4m3fn_to_e4m3fnuz)"
                if "fnuz" in self.name
                else ""
            )
            raise ValueError(
                f"{self.name}: codes must be {self.dtype.torch_dtype} of shape (N, K, M), got "
                f"{codes.dtype} {tuple(codes.shape)}{hint}"
            )
        if torch.isnan(codes.float()).any():
            raise ValueError(f"{self.name}: codes hold NaN; the checkpoint weight is corrupt")
        # fp32 (or bf16/fp16, exact in fp32) only: a float64 scale may not be representable in fp32
        if not scale.is_floating_point() or scale.dtype == torch.float64:
            raise ValueError(f"{self.name}: scale must be fp32 (or bf16/fp16), got {scale.dtype}")
        if not torch.isfinite(scale).all() or (scale < 0).any():
            raise ValueError(f"{self.name}: scale holds non-finite or negative values")


class _AiterFp8Scheme(_Fp8Scheme):
    """The AITER FP8 BMM kernel; the weight's amax is taken over ``reduce_dims`` of (N, K, M)."""

    reduce_dims: ClassVar[tuple[int, ...]]
    granularity: ClassVar[str]  # the weight scale's granularity, for error messages

    def prepare(self, weight: Tensor) -> PreparedWeight:
        _check_weight(weight, self.name)
        codes, scale = vllm_batched_tensor_quant(weight, self.dtype, self.reduce_dims)
        return _make_weight(self.name, codes, scale, (0, weight.shape[1]), self.dtype)

    def prepare_quantized(self, codes: Tensor, scale: Tensor) -> PreparedWeight:
        """Wrap existing fp8 ``codes`` (N, K, M) and their fp32 dequant ``scale`` at this scheme's
        granularity without re-quantizing: ``dequantize(float64)`` is exactly ``codes * scale``.

        ``scale``: fp8_per_tensor one value (shape (), (1,) or (1, 1, 1)); fp8_per_head (N, 1, 1);
        fp8_per_channel (N, 1, M). It must not vary along K: the kernel applies it after the K loop.
        ``mlaq.bmm.split_kv_b_proj_fp8_scaled`` gets them from a per-tensor / per-channel checkpoint.
        """
        self._check_stored(codes, scale)
        k = codes.shape[1]
        want = tuple(1 if d in self.reduce_dims else codes.shape[d] for d in range(3))
        if tuple(scale.shape) != want and not (want == (1, 1, 1) and scale.numel() == 1 and scale.dim() <= 3):
            raise ValueError(
                f"{self.name}: scale of shape {tuple(scale.shape)} does not fit codes {tuple(codes.shape)}; "
                f"this scheme has {self.granularity}, shape {want}"
                + ("" if want == (1, 1, 1) else " (a coarser scale must be expanded to it first)")
            )
        return _make_weight(self.name, codes, scale.reshape(want), (0, k), self.dtype)

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        w = self._weight(prepared)
        xq, xs = aiter_token_group_quant(x, self.dtype)  # (N, B, K) codes, (N, B, G) scales
        k = x.shape[2]
        acc = torch.zeros(x.shape[0], x.shape[1], w.shape[2], device=x.device)
        for g, k0 in enumerate(range(0, k, FP8_GROUP)):
            k1 = min(k0 + FP8_GROUP, k)
            acc = acc + _code_dot(xq[:, :, k0:k1], w.values[:, k0:k1, :]) * xs[:, :, g : g + 1]
        acc = acc * w.scale  # epilogue: (1|N, 1, 1|M) weight scale
        return acc.to(torch.bfloat16).float()

    def activation_values(self, x: Tensor) -> Tensor:
        xq, xs = aiter_token_group_quant(x, self.dtype)
        return xq.double() * _expand_groups(xs, x.shape[2]).double()


class Fp8PerTensor(_AiterFp8Scheme):
    base_name = "fp8_per_tensor"
    reduce_dims = (0, 1, 2)
    granularity = "one scale for the whole tensor"
    arithmetic = (
        "AITER FP8 BMM: {dtype} weight with ONE scale for the whole (N, K, M) tensor (vLLM "
        "dynamic_per_batched_tensor_quant: bf16 scale {max}/amax), activations quantized per token per "
        "128 along K (scale amax/{max}, multiply by its fp32 reciprocal), per-group code dot products "
        "times the activation scale accumulated in fp32, times the weight scale, bf16 output"
    )


class Fp8PerHead(_AiterFp8Scheme):
    base_name = "fp8_per_head"
    reduce_dims = (1, 2)
    granularity = "one scale per head"
    arithmetic = Fp8PerTensor.arithmetic.replace(
        "ONE scale for the whole (N, K, M) tensor", "one scale per head"
    )


class Fp8PerChannel(_AiterFp8Scheme):
    base_name = "fp8_per_channel"
    reduce_dims = (1,)
    granularity = "one scale per head per output column M"
    arithmetic = Fp8PerTensor.arithmetic.replace(
        "ONE scale for the whole (N, K, M) tensor", "one scale per head per output column"
    )


class Fp8PerBlock(_Fp8Scheme):
    """128x128 weight blocks over (K, M) per head, 1x128 activation groups (DeepSeek-V3 arithmetic).

    ``prepare_quantized(codes, scale)`` keeps a checkpoint's own codes and per-element scales
    losslessly, even where its 128-row blocks straddle heads (GLM-5: P + V = 448 is not a multiple
    of 128): K is cut into segments over which every head's scale is constant. The same holds for
    scales that change at every K row (W_UK of a per-channel checkpoint, whose output rows are K):
    the only kernel arithmetic that can apply a weight scale varying along K is this per-segment one.
    """

    base_name = "fp8_per_block"
    block = (128, 128)  # (K, M) block of the weight
    arithmetic = (
        "DeepSeek-V3 block FP8: {dtype} weight with one scale per 128x128 block of (K, M) per head "
        "(amax/{max}), activations quantized per token per 128 along K as DeepSeek-V3's act_quant does "
        "(x / (amax/{max}), true divisions), per K-block "
        "code dot products times (activation scale x weight scale) accumulated in fp32, bf16 output"
    )

    def prepare(self, weight: Tensor) -> PreparedWeight:
        _check_weight(weight, self.name)
        _, k, m = weight.shape
        t = quantize_fp8(weight.detach().to(torch.bfloat16).float(), self.dtype, (1, *self.block))
        scale = t.scale.repeat_interleave(self.block[1], dim=2)[:, :, :m]  # (N, Gk, Gm) -> (N, Gk, M)
        bounds = (*range(0, k, self.block[0]), k)
        return _make_weight(self.name, t.codes, scale, bounds, self.dtype, self.block[1])

    def prepare_quantized(self, codes: Tensor, scale: Tensor) -> PreparedWeight:
        """Wrap existing fp8 ``codes`` (N, K, M) and fp32 dequant ``scale`` (per element, or
        broadcastable to (N, K, M)) without re-quantizing: ``dequantize(float64)`` is exactly
        ``codes * scale``. Use ``mlaq.bmm.kv_b.split_kv_b_proj_fp8`` to get them from a checkpoint."""
        self._check_stored(codes, scale)
        try:
            full = scale.float().expand(codes.shape)  # (N, K, M)
        except RuntimeError as exc:
            raise ValueError(
                f"{self.name}: scale {tuple(scale.shape)} does not broadcast to {tuple(codes.shape)}"
            ) from exc
        k = codes.shape[1]
        changes = (full[:, 1:, :] != full[:, :-1, :]).any(dim=2).any(dim=0)  # (K-1,): scale changes at k+1
        cuts = {int(i) + 1 for i in torch.nonzero(changes).flatten()} | set(range(0, k, FP8_GROUP))
        bounds = (*sorted(cuts | {0}), k)
        # a scale constant along M (W_UK of a per-channel checkpoint) is stored once per K row
        m_block = codes.shape[2] if bool((full == full[:, :, :1]).all()) else 1
        return _make_weight(self.name, codes, full[:, list(bounds[:-1]), :], bounds, self.dtype, m_block)

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        w = self._weight(prepared)
        xq, xs = deepseek_token_group_quant(x, self.dtype)  # (N, B, K) codes, (N, B, G) scales
        k = x.shape[2]
        cuts = sorted(set(w.k_bounds) | set(range(0, k, FP8_GROUP)))  # segments never cross a group
        acc = torch.zeros(x.shape[0], x.shape[1], w.shape[2], device=x.device)
        for k0, k1 in itertools.pairwise(cuts):
            s = bisect.bisect_right(w.k_bounds, k0) - 1  # weight segment holding k0
            g = k0 // FP8_GROUP
            scale = xs[:, :, g : g + 1] * w.scale[:, s : s + 1, :]  # (N, B, 1) * (N, 1, M)
            acc = self._accumulate(acc, xq[:, :, k0:k1], w.values[:, k0:k1, :], scale)
        return acc.to(torch.bfloat16).float()

    def _accumulate(self, acc: Tensor, xq: Tensor, wq: Tensor, scale: Tensor) -> Tensor:
        """One K-segment into the fp32 sum: the exact code dot times the scales (two fp32 roundings)."""
        return acc + _code_dot(xq, wq) * scale

    def activation_values(self, x: Tensor) -> Tensor:
        xq, xs = deepseek_token_group_quant(x, self.dtype)
        return xq.double() * _expand_groups(xs, x.shape[2]).double()


def _code_dot(xq: Tensor, wq: Tensor) -> Tensor:
    """(N, B, k) x (N, k, M) fp8 code values -> exact dot products rounded once to fp32 (N, B, M)."""
    return torch.bmm(xq.double(), wq).float()


def _expand_groups(scales: Tensor, k: int) -> Tensor:
    """(N, B, G) group scales -> (N, B, K)."""
    return scales.repeat_interleave(FP8_GROUP, dim=2)[:, :, :k]


def _check_weight(weight: Tensor, name: str) -> None:
    if weight.dim() != 3 or min(weight.shape) < 1:
        raise ValueError(f"{name}: weight must be (N, K, M) with every dim >= 1, got {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError(f"{name}: weight holds NaN or inf; fix the checkpoint before quantizing it")
