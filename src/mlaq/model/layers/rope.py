"""Rotary position embedding as the DeepSeek-V3 family applies it: plain RoPE and DeepSeek's YaRN.

Conventions (checked against transformers 5.23 ``modeling_rope_utils._compute_yarn_parameters`` and the
DeepSeek-V2 authors' modeling code that vLLM's ``DeepseekScalingRotaryEmbedding`` follows):
- Frequencies are computed in float32: ``inv_freq[i] = 1 / theta ** (2i / R)`` (R = qk_rope_head_dim).
- YaRN blends interpolated (``inv_freq / factor``) and original frequencies with a linear ramp over the
  dimension range given by ``find_correction_range(beta_fast, beta_slow)`` (floor/ceil when ``truncate``).
- cos and sin are multiplied by ``yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)``;
  the softmax scale separately gets ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` (see MLAConfig).
- The rotation is computed in float32 and rounded once to the input dtype (DeepSeek's reference does this).
  A rotated tensor keeps its input layout, as vLLM and DeepSeek's reference do; transformers' DeepSeek-V3
  instead returns interleaved inputs de-interleaved. Dot products q_pe . k_pe are the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


class RopeLayout(Enum):
    """How the rotary half of q/k pairs its dimensions."""

    INTERLEAVED = "interleaved"  # pairs (x0, x1), (x2, x3), ...: how DeepSeek checkpoints store q_pe / k_pe
    HALF_SPLIT = "half_split"  # pairs (x_i, x_{i+R/2}): GPT-NeoX / Llama ``rotate_half``


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek's YaRN parameters (``rope_scaling`` with ``type: yarn`` in a config.json).

    Defaults follow the DeepSeek-V2 authors' code and vLLM: ``mscale=1``, ``mscale_all_dim=0``.
    (transformers differs only when exactly one of mscale / mscale_all_dim is given; real checkpoints
    give both.) ``attention_factor``, when given, replaces the cos/sin multiplier (transformers' key).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"YaRN factor must be > 0, got {self.factor}")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "YaRN original_max_position_embeddings must be a positive int, "
                f"got {self.original_max_position_embeddings}"
            )
        if not (self.beta_fast > 0 and self.beta_slow > 0):
            raise ValueError(f"YaRN beta_fast/beta_slow must be > 0, got {self.beta_fast}/{self.beta_slow}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"YaRN attention_factor must be > 0, got {self.attention_factor}")

    @property
    def cos_sin_scale(self) -> float:
        """Multiplier on cos and sin (so q_pe . k_pe scales by its square)."""
        if self.attention_factor is not None:
            return self.attention_factor
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale_factor(self) -> float:
        """Multiplier on the softmax scale 1/sqrt(P+R): ``yarn_get_mscale(factor, mscale_all_dim) ** 2``."""
        m = yarn_get_mscale(self.factor, self.mscale_all_dim)
        return m * m


def _find_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # The dimension whose wavelength completes ``num_rotations`` turns over ``max_pos`` tokens.
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def find_correction_range(
    beta_fast: float, beta_slow: float, dim: int, base: float, max_pos: int, truncate: bool = True
) -> tuple[float, float]:
    """YaRN's [low, high] dimension range between pure extrapolation and pure interpolation."""
    low = _find_correction_dim(beta_fast, dim, base, max_pos)
    high = _find_correction_dim(beta_slow, dim, base, max_pos)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def linear_ramp_mask(low: float, high: float, n: int) -> Tensor:
    """(n,) float32 ramp: 0 up to ``low``, 1 from ``high`` on."""
    if low == high:
        high += 0.001  # avoid 0/0, as every YaRN implementation does
    ramp = (torch.arange(n, dtype=torch.float32) - low) / (high - low)
    return ramp.clamp(0, 1)


@dataclass(frozen=True)
class Rope:
    """RoPE over the ``dim`` rotary channels of q and k (MLA: R = qk_rope_head_dim)."""

    dim: int
    theta: float
    layout: RopeLayout = RopeLayout.INTERLEAVED
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if self.dim <= 0 or self.dim % 2:
            raise ValueError(f"RoPE dimension must be a positive even number, got {self.dim}")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")

    def inv_freq(self, device: torch.device | None = None) -> Tensor:
        """(dim/2,) float32 angular frequencies, YaRN-blended when configured."""
        pos_freqs = self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        inv = 1.0 / pos_freqs
        if self.yarn is not None:
            y = self.yarn
            low, high = find_correction_range(
                y.beta_fast, y.beta_slow, self.dim, self.theta, y.original_max_position_embeddings, y.truncate
            )
            # extrapolation weight: 1 for fast-rotating dims (kept), 0 for slow ones (interpolated)
            keep = 1 - linear_ramp_mask(low, high, self.dim // 2)
            inv = (1.0 / (y.factor * pos_freqs)) * (1 - keep) + inv * keep
        return inv.to(device) if device is not None else inv

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin for integer ``positions`` (...,) -> two float32 tensors (..., dim/2)."""
        freqs = positions[..., None].float() * self.inv_freq(positions.device)  # (..., dim/2)
        scale = self.yarn.cos_sin_scale if self.yarn is not None else 1.0
        return freqs.cos() * scale, freqs.sin() * scale

    def apply(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Rotate ``x`` (..., dim); cos/sin broadcastable to (..., dim/2). Same layout and dtype out."""
        return apply_rope(x, cos, sin, self.layout)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: RopeLayout) -> Tensor:
    """Rotate pairs of ``x`` (..., R) by the angles behind cos/sin (..., R/2); computed in float32."""
    if x.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(f"RoPE: x has {x.shape[-1]} rotary channels but cos/sin have {cos.shape[-1]} angles")
    return rotate(x, *expand_cos_sin(cos, sin, layout), layout)


def expand_cos_sin(cos: Tensor, sin: Tensor, layout: RopeLayout) -> tuple[Tensor, Tensor]:
    """cos, sin (..., R/2) -> cos and signed sin per channel (..., R), in ``layout``'s channel order:
    channel x1 of a pair gets (cos, -sin), channel x2 gets (cos, +sin)."""
    if layout is RopeLayout.INTERLEAVED:
        return cos.repeat_interleave(2, dim=-1), torch.stack((-sin, sin), dim=-1).flatten(-2)
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, layout: RopeLayout) -> Tensor:
    """Rotate ``x`` (..., R) with per-channel cos / signed sin (..., R) from :func:`expand_cos_sin`.

    x * cos + partner(x) * signed_sin, where partner swaps the two channels of each pair: per pair
    (x1 * cos - x2 * sin, x2 * cos + x1 * sin), the same float32 operations, rounded once to x's dtype.
    """
    xf = x.float()
    if layout is RopeLayout.INTERLEAVED:
        partner = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (..., R/2, 2) pairs swapped -> (..., R)
    else:
        partner = xf.roll(x.shape[-1] // 2, dims=-1)  # (x2, x1)
    return (xf * cos + partner * signed_sin).to(x.dtype)


class RopeTable:
    """cos/sin of a :class:`Rope` for positions 0..n-1, computed once per device and extended (doubling)
    when a larger position is asked for. Values equal ``Rope.cos_sin`` of the same positions: the table
    is built by the same float32 formula, element by element."""

    def __init__(self, rope: Rope) -> None:
        self.rope = rope
        self._tables: dict[torch.device, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def cos_sin(self, positions: Tensor, max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin for integer ``positions`` (...,) -> two float32 tensors (..., dim/2).

        ``max_position`` (the largest value in ``positions``, if the caller knows it) spares a sync."""
        table = self._table(positions, max_position)
        return table[0][positions], table[1][positions]

    def rotation(self, positions: Tensor, max_position: int | None = None) -> tuple[Tensor, Tensor]:
        """Per-channel cos and signed sin (..., dim) for :func:`rotate` in the rope's own layout."""
        table = self._table(positions, max_position)
        return table[2][positions], table[3][positions]

    def _table(self, positions: Tensor, max_position: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        top = int(positions.max()) if max_position is None else max_position
        table = self._tables.get(positions.device)
        if table is None or table[0].shape[0] <= top:
            size = max(top + 1, 2 * (0 if table is None else table[0].shape[0]), 64)
            cos, sin = self.rope.cos_sin(torch.arange(size, device=positions.device))  # (size, dim/2)
            table = (cos, sin, *expand_cos_sin(cos, sin, self.rope.layout))
            self._tables[positions.device] = table
        return table
