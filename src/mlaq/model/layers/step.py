"""Where one forward call's new tokens sit: per-row positions, RoPE angles and the causal mask, built
ONCE per call and shared by every layer (main and MTP).

Row b's T new tokens sit at consecutive positions ``starts[b] .. starts[b] + T - 1`` (right-padded
rows simply continue their positions; their outputs are ignored by the caller). Keys are indexed by
position, ``num_keys = max position + 1`` of them; a query at position p sees key j iff j <= p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.model.layers.rope import RopeTable


@dataclass(frozen=True)
class StepPositions:
    positions: Tensor  # (B, T) int64
    starts: tuple[int, ...]  # (B,) positions[:, 0], as Python ints (no sync per layer)
    num_keys: int  # K = max position + 1
    cos: Tensor  # (B, T, R) float32, per channel (mlaq.model.layers.rope.rotate)
    sin: Tensor  # (B, T, R) float32, per channel and signed
    mask: Tensor | None  # (B, T, K) bool causal mask; None when every query sees all K keys
    causal: bool = False  # mask is exactly the square top-left causal mask (every row starts at 0, T > 1)

    @property
    def uniform(self) -> bool:
        """Every row starts at the same position (no per-row scatter needed)."""
        return len(set(self.starts)) == 1

    def with_key_mask(self, key_mask: Tensor | None) -> Tensor | None:
        """The causal mask AND an extra (B, T, K' >= K) key mask (DSA top-k; True = keep)."""
        if key_mask is None:
            return self.mask
        key_mask = key_mask[:, :, : self.num_keys]
        return key_mask if self.mask is None else self.mask & key_mask

    def visible(self) -> Tensor:
        """The causal mask as a tensor even where ``mask`` is None (the DSA indexer needs one)."""
        if self.mask is not None:
            return self.mask
        b, t = self.positions.shape
        return torch.ones(b, t, self.num_keys, dtype=torch.bool, device=self.positions.device)


def step_positions(
    starts: Sequence[int], num_tokens: int, table: RopeTable, device: torch.device | str | None = None
) -> StepPositions:
    """Rows starting at ``starts`` (B,), ``num_tokens`` (T) new tokens each."""
    if num_tokens < 1:
        raise ValueError(f"a forward call needs at least one new token per row, got T = {num_tokens}")
    if min(starts) < 0:
        raise ValueError(f"positions must be >= 0, got row starts {list(starts)}")
    positions = torch.tensor(list(starts), device=device)[:, None] + torch.arange(num_tokens, device=device)
    return _build(positions, tuple(starts), table)  # positions (B, T)


def from_positions(positions: Tensor, table: RopeTable) -> StepPositions:
    """Given per-row positions (B, T): integer, >= 0, consecutive within each row."""
    if positions.dim() != 2 or positions.is_floating_point():
        raise ValueError(f"positions must be integer (B, T), got {positions.dtype} {tuple(positions.shape)}")
    starts = tuple(positions[:, 0].tolist())
    if min(starts) < 0:
        raise ValueError(f"positions must be >= 0, got row starts {list(starts)}")
    t = positions.shape[1]
    if t > 1:
        expected = positions[:, :1] + torch.arange(t, device=positions.device)  # (B, T)
        if not torch.equal(positions, expected):
            raise ValueError("positions must be consecutive within each row (start, start + 1, ...)")
    return _build(positions.long(), starts, table)


def _build(positions: Tensor, starts: tuple[int, ...], table: RopeTable) -> StepPositions:
    t = positions.shape[1]
    num_keys = max(starts) + t
    cos, sin = table.rotation(positions, num_keys - 1)
    mask = None
    if t > 1 or len(set(starts)) > 1:
        key_pos = torch.arange(num_keys, device=positions.device)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # (B, T, K)
    # every row at 0..T-1 over K = T keys: query i sees keys 0..i, the lower triangle itself
    return StepPositions(positions, starts, num_keys, cos, sin, mask, mask is not None and max(starts) == 0)
