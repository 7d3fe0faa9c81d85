"""Block geometry shared by the FP8 and MX quantizers: ragged blocks, block amax, scale expansion.

A block spec has one entry per dim: an int = block length along that dim (the last block may be
shorter: a "ragged" edge, as DeepSeek-V3 checkpoints store 128x128 blocks of a 300x200 weight),
None = the whole dim. Scales have one entry per block: ceil(dim / block) per dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

Block = tuple[int | None, ...]


def resolve_block(shape: Sequence[int], block: Sequence[int | None]) -> tuple[int, ...]:
    """Concrete block lengths (None -> the whole dim) after validating ``block`` against ``shape``."""
    if len(shape) == 0:
        raise ValueError("cannot block-quantize a 0-d tensor; reshape it to (1,) first")
    if len(block) != len(shape):
        raise ValueError(
            f"block {tuple(block)} has {len(block)} entries but the tensor has shape {tuple(shape)}; "
            "give one entry per dim (an int block length, or None for the whole dim)"
        )
    out = []
    for dim, b in zip(shape, block, strict=True):
        if b is None:
            out.append(max(int(dim), 1))
        elif isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"block entries must be positive ints or None, got {b!r} in {tuple(block)}")
        else:
            out.append(int(b))
    return tuple(out)


def grid_shape(shape: Sequence[int], lengths: Sequence[int]) -> tuple[int, ...]:
    """Number of blocks per dim: ceil(dim / block)."""
    return tuple(math.ceil(d / b) for d, b in zip(shape, lengths, strict=True))


def block_amax(x: Tensor, lengths: Sequence[int]) -> Tensor:
    """Per-block max |x| (NaN propagates), shape ``grid_shape(x.shape, lengths)``.

    Ragged edges are zero-padded: |0| never raises a block's amax, so a short tail block's amax
    is taken over the elements present, exactly as the kernels mask their loads.
    """
    grid = grid_shape(x.shape, lengths)
    pad = []  # F.pad order: last dim first, (before, after) pairs
    for d, b, g in reversed(list(zip(x.shape, lengths, grid, strict=True))):
        pad += [0, g * b - d]
    a = torch.nn.functional.pad(x.abs(), pad) if any(pad) else x.abs()
    # (d0, d1, ...) -> (g0, b0, g1, b1, ...): block index and offset inside the block per dim
    split = [s for g, b in zip(grid, lengths, strict=True) for s in (g, b)]
    a = a.reshape(split)
    return a.amax(dim=tuple(range(1, 2 * len(grid), 2)))


def expand_blocks(s: Tensor, shape: Sequence[int], lengths: Sequence[int]) -> Tensor:
    """Broadcast one value per block back to the element shape (ragged edges cut off)."""
    for dim, b in enumerate(lengths):
        if b != 1 and s.shape[dim] != 1:  # a single block along a dim broadcasts for free
            s = s.repeat_interleave(b, dim=dim)
    return s[tuple(slice(0, d) for d in shape)].expand(tuple(shape))
