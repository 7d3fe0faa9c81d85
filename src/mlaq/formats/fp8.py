"""FP8 (e4m3fn, e4m3fnuz, e5m2): the saturating cast and one general blocked quantizer.

Every granularity the engines use is one block spec (one entry per dim, see ``blocks.py``):
  per-tensor              (None, ..., None)      vLLM/AITER "per batched tensor": ONE scale for (N, L, P)
  per-channel on axis a   1 on axis a, None elsewhere  (per head = per channel on the head axis)
  per-token-group g       (1, ..., 1, g)         DeepSeek-V3 / AITER 1x128 activations; ragged tail group
  2-D blocks              (..., 128, 128)        DeepSeek-V3 ``weight_scale_inv``; ragged edges

Scale per block = amax / fp8_max in fp32; codes = fp8_cast(x / scale) (true fp32 divisions, as AITER's
torch reference and DeepSeek-V3's ``act_quant`` do). vLLM's Triton ``_per_token_group_quant_fp8``
(vLLM 0.32 model_executor/layers/quantization/utils/fp8_utils.py) forms the scale as
``amax * fp32(1 / fp8_max)`` instead, a multiply by the rounded reciprocal that differs from
``amax / 448`` by one fp32 ulp for about half of all bf16 amax; it then divides ``x / scale`` for the
codes. ``mlaq.bmm.fp8_quant.vllm_token_group_quant`` emulates that kernel.

All-zero blocks: engines differ only in the stored scale (the codes are 0 either way):
AITER ``pertoken_quant`` (torch reference) stores scale 1.0; vLLM's Triton group quant floors amax at
eps=1e-10; vLLM's CUDA kernels floor the scale at 1/(448*512); DeepSeek's inference kernel floors amax
at 1e-4. mlaq emulates AITER by default (amax_floor=0: zero block -> scale 1.0); pass ``amax_floor`` to
emulate the others (1e-10 vLLM Triton, 1/512 vLLM CUDA, 1e-4 DeepSeek).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from mlaq.formats.blocks import Block, block_amax, expand_blocks, grid_shape, resolve_block


class Fp8Dtype(Enum):
    """The three FP8 element types the engines use."""

    E4M3FN = "e4m3fn"  # OCP E4M3: NVIDIA, gfx950, DeepSeek-V3 checkpoints
    E4M3FNUZ = "e4m3fnuz"  # AMD gfx942 (MI300): bias 8, one NaN (0x80), no -0
    E5M2 = "e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {
            Fp8Dtype.E4M3FN: torch.float8_e4m3fn,
            Fp8Dtype.E4M3FNUZ: torch.float8_e4m3fnuz,
            Fp8Dtype.E5M2: torch.float8_e5m2,
        }[self]

    @property
    def max(self) -> float:
        """Largest finite magnitude: 448, 240, 57344."""
        return {Fp8Dtype.E4M3FN: 448.0, Fp8Dtype.E4M3FNUZ: 240.0, Fp8Dtype.E5M2: 57344.0}[self]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> Fp8Dtype:
        for member in cls:
            if member.torch_dtype == dtype:
                return member
        known = [m.torch_dtype for m in cls]
        raise ValueError(f"{dtype} is not an FP8 dtype mlaq knows; expected one of {known}")


def fp8_cast(x: Tensor, dtype: Fp8Dtype) -> Tensor:
    """Saturating round-to-nearest-even cast to FP8; NaN stays NaN, ±inf -> ±max.

    Clamping first makes the result independent of the torch version: torch 2.13 saturates e4m3fn
    but overflows e5m2 to inf and the fnuz types to NaN; older torch gave NaN for e4m3fn too.
    Input is taken as fp32 (the engines quantize in fp32; bf16 -> fp32 is exact).
    """
    x = x.float()
    return x.clamp(-dtype.max, dtype.max).to(dtype.torch_dtype)


def fp8_has_nan(codes: Tensor) -> bool:
    """Whether FP8 ``codes`` hold a NaN, read from the bytes (a float conversion of a 16 M-element weight
    costs ~0.1 s on a CPU): e4m3fn 0x7F / 0xFF, e4m3fnuz 0x80, e5m2 exponent 11111 with a mantissa."""
    raw = codes.view(torch.uint8)
    if codes.dtype == torch.float8_e4m3fnuz:
        return bool((raw == 0x80).any())
    if codes.dtype == torch.float8_e5m2:
        return bool(((raw & 0x7F) > 0x7C).any())
    if codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{codes.dtype} is not an FP8 dtype")
    return bool(((raw & 0x7F) == 0x7F).any())


@dataclass(frozen=True)
class Fp8Tensor:
    """Blocked FP8: ``codes`` (x's shape, torch fp8) and one fp32 ``scale`` per block (a dequant multiplier)."""

    codes: Tensor
    scale: Tensor
    block: Block
    dtype: Fp8Dtype

    def __post_init__(self) -> None:
        if self.codes.dtype != self.dtype.torch_dtype:
            raise ValueError(f"codes are {self.codes.dtype}, expected {self.dtype.torch_dtype}")
        lengths = resolve_block(self.codes.shape, self.block)
        want = grid_shape(self.codes.shape, lengths)
        if tuple(self.scale.shape) != want or self.scale.dtype != torch.float32:
            raise ValueError(
                f"scale must be float32 of shape {want} (ceil(dim/block) for codes {tuple(self.codes.shape)} "
                f"and block {self.block}), got {self.scale.dtype} {tuple(self.scale.shape)}"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    def expanded_scale(self) -> Tensor:
        """The scale broadcast to the codes' shape, fp32."""
        return expand_blocks(self.scale, self.shape, resolve_block(self.shape, self.block))

    def dequantize(self) -> Tensor:
        """codes * scale, fp32. The product is formed in float64, where it is exact (<= 4+24 significant
        bits), then rounded to fp32 once: the same value as an fp32 multiply, the kernels' dequant."""
        return (self.codes.double() * self.expanded_scale().double()).float()

    @classmethod
    def from_checkpoint(cls, codes: Tensor, scale_inv: Tensor, block: Block = (128, 128)) -> Fp8Tensor:
        """Wrap a DeepSeek-V3-style FP8 weight: ``weight`` (fp8) + ``weight_scale_inv`` (fp32, one per block,
        shape [ceil(out/128), ceil(in/128)], a DEQUANT multiplier = amax/448 of the original block).

        Rejects non-finite weights (NaN codes, non-finite or negative scales) with a ValueError.
        """
        dtype = Fp8Dtype.from_torch(codes.dtype)
        if fp8_has_nan(codes):
            raise ValueError("FP8 checkpoint weight holds NaN codes; the checkpoint is corrupt")
        scale = scale_inv.float() if scale_inv.dtype in (torch.bfloat16, torch.float16) else scale_inv
        if scale.dtype != torch.float32:
            raise ValueError(
                f"weight_scale_inv must be a float tensor (fp32 in DeepSeek-V3), got {scale.dtype}"
            )
        if not torch.isfinite(scale).all() or (scale < 0).any():
            raise ValueError(
                "weight_scale_inv holds non-finite or negative scales; the checkpoint is corrupt"
            )
        return cls(codes=codes, scale=scale.contiguous(), block=tuple(block), dtype=dtype)


def quantize_fp8(x: Tensor, dtype: Fp8Dtype, block: Block, *, amax_floor: float = 0.0) -> Fp8Tensor:
    """Blocked FP8 quantization: scale = max(amax, amax_floor) / dtype.max per block (fp32), then
    codes = fp8_cast(x / scale). A block whose (floored) amax is 0 gets scale 1.0 (AITER's convention).

    A NaN in a block makes that block's scale NaN (and its codes NaN): it is not hidden.
    """
    if not (amax_floor >= 0 and math.isfinite(amax_floor)):
        raise ValueError(f"amax_floor must be a finite number >= 0, got {amax_floor!r}")
    lengths = resolve_block(x.shape, block)
    xf = x.float()
    amax = block_amax(xf, lengths)  # fp32, one per block
    if amax_floor > 0:
        amax = amax.clamp(min=amax_floor)
    scale = amax / dtype.max  # fp32 division, rounded once, as the kernels do
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    codes = fp8_cast(xf / expand_blocks(scale, xf.shape, lengths), dtype)
    return Fp8Tensor(codes=codes, scale=scale.contiguous(), block=tuple(block), dtype=dtype)


def quantize_fp8_per_tensor(x: Tensor, dtype: Fp8Dtype) -> Fp8Tensor:
    """One scale for the whole tensor (AITER/vLLM "per batched tensor" for the MLA BMM weights)."""
    return quantize_fp8(x, dtype, (None,) * x.dim())


def quantize_fp8_per_channel(x: Tensor, dtype: Fp8Dtype, axis: int) -> Fp8Tensor:
    """One scale per index along ``axis`` (per head: the head axis; per token: the token axis)."""
    axis = _axis(axis, x.dim())
    return quantize_fp8(x, dtype, tuple(1 if d == axis else None for d in range(x.dim())))


def quantize_fp8_per_token_group(x: Tensor, dtype: Fp8Dtype, group_size: int = 128) -> Fp8Tensor:
    """One scale per ``group_size`` contiguous elements of the last axis, per row (ragged tail group)."""
    return quantize_fp8(x, dtype, (1,) * (x.dim() - 1) + (group_size,))


def quantize_fp8_per_block(x: Tensor, dtype: Fp8Dtype, block: tuple[int, int] = (128, 128)) -> Fp8Tensor:
    """2-D blocks over the last two axes (DeepSeek-V3 weights), one block per leading index."""
    if x.dim() < 2:
        raise ValueError(f"per-block quantization needs >= 2 dims, got shape {tuple(x.shape)}")
    return quantize_fp8(x, dtype, (1,) * (x.dim() - 2) + tuple(block))


def e4m3fn_to_e4m3fnuz(t: Fp8Tensor) -> Fp8Tensor:
    """Convert an e4m3fn tensor for AMD gfx942 as vLLM's ``normalize_e4m3fn_to_e4m3fnuz`` does: keep the
    bytes, zero 0x80 (-0 in e4m3fn, NaN in e4m3fnuz), double the scales. Exact for every finite code:
    the same byte is worth exactly half in e4m3fnuz (bias 8 vs 7). NaN codes are rejected."""
    if t.dtype is not Fp8Dtype.E4M3FN:
        raise ValueError(f"e4m3fn_to_e4m3fnuz needs an E4M3FN tensor, got {t.dtype.name}")
    raw = t.codes.view(torch.uint8)
    if ((raw & 0x7F) == 0x7F).any():
        raise ValueError("e4m3fn tensor holds NaN codes (0x7F/0xFF); they have no e4m3fnuz equivalent")
    raw = torch.where(raw == 0x80, torch.zeros_like(raw), raw)
    return Fp8Tensor(
        codes=raw.view(torch.float8_e4m3fnuz), scale=t.scale * 2.0, block=t.block, dtype=Fp8Dtype.E4M3FNUZ
    )


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for a {ndim}-d tensor")
    return axis % ndim
