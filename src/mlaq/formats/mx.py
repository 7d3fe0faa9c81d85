"""OCP Microscaling (MX v1.0): blocks of 32 elements along one axis share an E8M0 scale 2^u.

Elements are x / 2^u rounded to nearest even and clamped to ±max of the element type (sign kept).
The division by a power of two is exact in fp32 (x * 2^-u, both representable) unless the quotient
is an fp32 subnormal, far below every element's smallest subnormal, so it never changes a code.

Special blocks (see ``scale_rules``): all-zero -> scale byte 0x00 and zero codes; a NaN or ±inf
anywhere in a block -> scale byte 0xFF, codes 0, and the whole block dequantizes to NaN.
The tail block along the axis may be shorter than ``block_size`` (K=192, or K not a multiple of 32):
its amax is over the elements present.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.formats.e2m1 import e2m1_decode, e2m1_encode, e2m1_round, pack_e2m1, unpack_e2m1
from mlaq.formats.fp8 import Fp8Dtype, fp8_cast
from mlaq.formats.scale_rules import E8M0_BIAS, E8M0_NAN, MxElem, ScaleRule, e8m0_decode, e8m0_scale_exponent


def _fp8_of(elem: MxElem) -> Fp8Dtype:
    """The FP8 type of an MXFP8 element (OCP E4M3 / E5M2)."""
    return {MxElem.E4M3: Fp8Dtype.E4M3FN, MxElem.E5M2: Fp8Dtype.E5M2}[elem]


@dataclass(frozen=True)
class MxTensor:
    """MX-quantized tensor. ``codes``: uint8 per element (E2M1 codes 0..15 unpacked, or the fp8 element
    bytes); ``scales``: uint8 E8M0 bytes, x's shape with ``axis`` -> ceil(K / block_size).
    ``rule`` is None for tensors loaded from a checkpoint (the producer's rule is unknown)."""

    codes: Tensor
    scales: Tensor
    elem: MxElem
    rule: ScaleRule | None
    axis: int
    block_size: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        want = list(self.shape)
        want[self.axis] = math.ceil(self.shape[self.axis] / self.block_size)
        if tuple(self.codes.shape) != self.shape or self.codes.dtype != torch.uint8:
            raise ValueError(
                f"codes must be uint8 of shape {self.shape}, got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        if list(self.scales.shape) != want or self.scales.dtype != torch.uint8:
            raise ValueError(
                f"scales must be uint8 E8M0 bytes of shape {tuple(want)} (axis {self.axis} -> "
                f"ceil(K/{self.block_size})), got {self.scales.dtype} {tuple(self.scales.shape)}"
            )

    def element_values(self) -> Tensor:
        """The unscaled element values, fp32."""
        if self.elem is MxElem.E2M1:
            return e2m1_decode(self.codes)
        return self.codes.view(_fp8_of(self.elem).torch_dtype).float()

    def dequantize(self) -> Tensor:
        """element * 2^u in fp32 (exact: a <= 4-bit-mantissa value times a power of two)."""
        scale = e8m0_decode(self.scales).repeat_interleave(self.block_size, dim=self.axis)
        scale = scale.narrow(self.axis, 0, self.shape[self.axis])
        return self.element_values() * scale

    def packed(self) -> Tensor:
        """E2M1 only: two codes per byte along ``axis``, element 2i in the low nibble."""
        if self.elem is not MxElem.E2M1:
            raise ValueError(f"only E2M1 codes are packed; {self.elem.name} elements are whole bytes")
        return pack_e2m1(self.codes, self.axis)

    @classmethod
    def from_packed(
        cls,
        packed: Tensor,
        scales: Tensor,
        elem: MxElem = MxElem.E2M1,
        axis: int = -1,
        *,
        size: int | None = None,
        block_size: int = 32,
    ) -> MxTensor:
        """Wrap checkpoint tensors (Quark: ``weight`` fp4x2 uint8 + ``weight_scale`` E8M0 uint8).

        For E2M1, ``packed`` holds two codes per byte along ``axis`` (``size`` = K if K is odd); for
        E4M3/E5M2 it holds the element bytes. Rejects NaN scales (0xFF): a checkpoint weight must be finite.
        """
        axis = axis % packed.dim()
        if scales.dtype == torch.float8_e8m0fnu:
            scales = scales.view(torch.uint8)
        if elem is MxElem.E2M1:
            codes = unpack_e2m1(packed, axis, size)
        else:
            codes = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
            if not torch.isfinite(codes.view(_fp8_of(elem).torch_dtype).float()).all():
                raise ValueError(
                    f"{elem.name} checkpoint weight holds NaN/inf element codes; it is not finite"
                )
        if (scales == E8M0_NAN).any():
            raise ValueError("MX checkpoint scales hold 0xFF (NaN) bytes; the weight is not finite")
        return cls(codes, scales, elem, None, axis, block_size, tuple(codes.shape))


def _blocks(x: Tensor, axis: int, block_size: int) -> tuple[Tensor, int]:
    """x -> fp32 (..., nb, block_size) with ``axis`` moved last and the ragged tail zero-padded."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if x.dim() == 0:
        raise ValueError("cannot MX-quantize a 0-d tensor; reshape it to (1,) first")
    xf = x.float().movedim(axis, -1)
    k = xf.shape[-1]
    nb = math.ceil(k / block_size)
    if nb * block_size != k:
        xf = torch.nn.functional.pad(xf, (0, nb * block_size - k))  # zeros never raise a block's amax
    return xf.reshape(*xf.shape[:-1], nb, block_size), k  # (..., K) -> (..., nb, bs)


def _scaled_elements(xb: Tensor, elem: MxElem, rule: ScaleRule) -> tuple[Tensor, Tensor]:
    """(..., nb, bs) fp32 -> (u int32 (..., nb), x / 2^u (..., nb, bs), NaN blocks zeroed)."""
    u = e8m0_scale_exponent(xb.abs().amax(dim=-1), elem, rule)
    bad = u == E8M0_NAN - E8M0_BIAS
    inv = torch.exp2((-u).clamp(max=E8M0_BIAS).double()).float()  # 2^-u, exact in fp32
    y = xb * inv.unsqueeze(-1)
    # unconditional (no host sync: the same ops on a GPU, on `meta` and under torch.compile)
    return u, torch.where(bad.unsqueeze(-1), torch.zeros_like(y), y)


def _unblock(t: Tensor, k: int, axis: int) -> Tensor:
    """(..., nb, bs) -> original layout: drop the tail padding, move the axis back."""
    t = t.reshape(*t.shape[:-2], -1)[..., :k]
    return t.movedim(-1, axis).contiguous()


def quantize_mx(x: Tensor, elem: MxElem, rule: ScaleRule, axis: int = -1, block_size: int = 32) -> MxTensor:
    """MX-quantize x along ``axis`` in blocks of ``block_size`` (ragged tail allowed)."""
    axis = axis % max(x.dim(), 1)
    xb, k = _blocks(x, axis, block_size)
    u, y = _scaled_elements(xb, elem, rule)
    codes = e2m1_encode(y) if elem is MxElem.E2M1 else fp8_cast(y, _fp8_of(elem)).view(torch.uint8)
    scales = (u + E8M0_BIAS).to(torch.uint8).movedim(-1, axis).contiguous()
    return MxTensor(_unblock(codes, k, axis), scales, elem, rule, axis, block_size, tuple(x.shape))


def mx_fake_quant(x: Tensor, elem: MxElem, rule: ScaleRule, axis: int = -1, block_size: int = 32) -> Tensor:
    """fp32 values equal to ``quantize_mx(...).dequantize()`` without building the codes (the hot path)."""
    axis = axis % max(x.dim(), 1)
    xb, k = _blocks(x, axis, block_size)
    u, y = _scaled_elements(xb, elem, rule)
    q = e2m1_round(y) if elem is MxElem.E2M1 else fp8_cast(y, _fp8_of(elem)).float()
    scale = torch.exp2(u.clamp(max=E8M0_BIAS).double()).float()
    scale = torch.where(u == E8M0_NAN - E8M0_BIAS, torch.full_like(scale, float("nan")), scale)
    return _unblock(q * scale.unsqueeze(-1), k, axis)
