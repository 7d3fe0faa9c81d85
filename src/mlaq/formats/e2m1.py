"""E2M1 (FP4) elements: RNE encode with saturation, decode, and nibble packing.

Codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign. Packing (AMD and PyTorch tooling):
element 2i in the LOW nibble, element 2i+1 in the high nibble. torch's ``float4_e2m1fn_x2`` has no
casts, so the nibbles are built here.
"""

from __future__ import annotations

import torch
from torch import Tensor

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_encode(y: Tensor) -> Tensor:
    """Round to the nearest E2M1 value, ties to even, saturating at ±6 (±inf -> ±6); uint8 codes 0..15.

    Each threshold is a midpoint of two neighbours; at a tie the one with an even code (mantissa
    bit 0) wins, so the comparison is ``>`` where the lower neighbour is even and ``>=`` where the
    upper one is. The sign bit follows the sign of y, -0 included. NaN encodes as ±0.
    """
    a = y.abs()
    mag = (
        (a > 0.25).to(torch.uint8)  # 0 | 0.5: 0 is even
        + (a >= 0.75)  # 0.5 | 1: 1 (code 2) is even
        + (a > 1.25)  # 1 | 1.5: 1 is even
        + (a >= 1.75)  # 1.5 | 2: 2 (code 4) is even
        + (a > 2.5)  # 2 | 3: 2 is even
        + (a >= 3.5)  # 3 | 4: 4 (code 6) is even
        + (a > 5.0)  # 4 | 6: 4 is even; everything above 6 saturates to 6
    )
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 -> fp32 values (exact)."""
    table = torch.tensor(
        E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device
    )
    return table[(codes.to(torch.int64) & 0xF)]


def e2m1_round(y: Tensor) -> Tensor:
    """fp32 values equal to ``e2m1_decode(e2m1_encode(y))`` (NaN stays NaN), computed arithmetically:
    the E2M1 grid has spacing 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6], and on each stretch the even
    multiple of the spacing is the even code, so torch.round (half to even) on |y| / spacing is RNE.
    Multiplying and dividing by the power-of-two spacing is exact. A second formulation, on purpose:
    the exhaustive bf16 test pins both to ml_dtypes."""
    a = y.float().abs().clamp(max=E2M1_MAX)
    inv = torch.where(a < 2.0, 2.0, torch.where(a < 4.0, 1.0, 0.5))  # 1 / spacing
    return torch.copysign(torch.round(a * inv).div_(inv), y.float())


def pack_e2m1(codes: Tensor, axis: int = -1) -> Tensor:
    """Pack uint8 codes 0..15 two per byte along ``axis``: element 2i low nibble, 2i+1 high nibble.

    An odd length is padded with one +0 code; pass ``size`` to ``unpack_e2m1`` to drop it again.
    """
    if codes.dtype != torch.uint8:
        raise ValueError(f"E2M1 codes must be uint8 (0..15), got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("E2M1 codes must be in 0..15 (4 bits); got a larger value")
    c = codes.movedim(axis, -1)
    if c.shape[-1] % 2:
        c = torch.nn.functional.pad(c, (0, 1))
    pairs = c.reshape(*c.shape[:-1], c.shape[-1] // 2, 2)  # (..., K) -> (..., K/2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.movedim(-1, axis).contiguous()


def unpack_e2m1(packed: Tensor, axis: int = -1, size: int | None = None) -> Tensor:
    """Inverse of ``pack_e2m1``: uint8 (or float4_e2m1fn_x2) bytes -> uint8 codes, 2x along ``axis``
    (or ``size`` elements, which must be 2n or 2n-1 for n bytes)."""
    if packed.dtype == torch.float4_e2m1fn_x2:
        packed = packed.view(torch.uint8)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed E2M1 must be uint8 or float4_e2m1fn_x2, got {packed.dtype}")
    p = packed.movedim(axis, -1)
    n = p.shape[-1]
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * n)  # (..., n, 2) -> (..., 2n)
    if size is not None:
        if size not in (2 * n, 2 * n - 1):
            raise ValueError(f"size {size} does not fit {n} packed bytes (expected {2 * n - 1} or {2 * n})")
        codes = codes[..., :size]
    return codes.movedim(-1, axis).contiguous()
