"""Paged allocation of cache slots: fixed-size blocks, a free list, one block table per sequence.

A slot is one token's place in the cache: slot = block_id * block_size + offset. One block table
serves every layer (the per-layer storage in ``kv_cache`` is indexed by the same slots), as in
vLLM's paged attention. Sequences grow a slot at a time (decode) or k+1 at a time (speculative
verification) and shrink again when draft tokens are rejected (``truncate``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor


@dataclass(frozen=True)
class BatchSlots:
    """Where a batch of sequences' cached tokens live: what a gather needs, computed once a step.

    Plain ints; the tensors are built on first use (a lone sequence in consecutive slots is read as
    one slice of the cache and needs none: a decode step then makes no tensor here)."""

    tables: tuple[tuple[int, ...], ...]  # per sequence, the blocks of its first S_max tokens (0-padded)
    lens: tuple[int, ...]  # cached tokens per sequence
    block_size: int
    first_slot: int | None = None  # one sequence whose S_max slots are consecutive from here, else None

    @property
    def num_slots(self) -> int:
        """S_max, the longest sequence's cached tokens."""
        return max(self.lens, default=0)

    @property
    def padded(self) -> bool:
        """False when every sequence has S_max tokens (nothing to mask)."""
        return any(n != self.num_slots for n in self.lens)

    @cached_property
    def slots(self) -> Tensor:
        """(B, S_max) int64; padded positions point at slot 0 and are masked."""
        width = len(self.tables[0]) if self.tables else 1
        tables = torch.tensor(self.tables, dtype=torch.int64).view(len(self.lens), width)  # (B, max_blocks)
        pos = torch.arange(self.num_slots)  # (S_max,)
        slots = tables[:, pos // self.block_size] * self.block_size + pos % self.block_size  # (B, S_max)
        return slots.masked_fill(~self.mask, 0) if self.padded else slots

    @cached_property
    def lengths(self) -> Tensor:
        """(B,) int64, cached tokens per sequence."""
        return torch.tensor(self.lens, dtype=torch.int64)

    @property
    def mask(self) -> Tensor:
        """(B, S_max) bool, True where a position holds one of the sequence's tokens."""
        return torch.arange(self.num_slots)[None, :] < self.lengths[:, None]


class BlockManager:
    """Owns which blocks are free and which belong to which sequence (by any hashable id)."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        if num_blocks < 1 or block_size < 1 or max_model_len < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}), block_size ({block_size}) and max_model_len "
                f"({max_model_len}) must all be at least 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        # Pop from the end: the lowest block ids are handed out first (easier to read in tests).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self._lengths: dict[Hashable, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil

    def check_fits(self, num_tokens: int, what: str = "prompt") -> None:
        """Raise ValueError when ``num_tokens`` could never be cached, even in an empty pool."""
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"{what} of {num_tokens} tokens does not fit max_model_len={self.max_model_len}; "
                "shorten it or raise max_model_len"
            )
        if self.blocks_needed(num_tokens) > self.num_blocks:
            raise ValueError(
                f"{what} of {num_tokens} tokens needs {self.blocks_needed(num_tokens)} cache blocks of "
                f"{self.block_size} tokens but the KV cache pool has only {self.num_blocks}; "
                "raise the number of cache blocks or shorten it"
            )

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Whether ``seq_id`` (new or existing) can be brought to ``num_tokens`` slots right now."""
        have = len(self._tables.get(seq_id, ()))
        return self.blocks_needed(num_tokens) - have <= len(self._free)

    def grow(self, seq_id: Hashable, num_tokens: int) -> None:
        """Give ``seq_id`` slots for ``num_tokens`` tokens in all (allocating it if new)."""
        self.check_fits(num_tokens, what=f"sequence {seq_id!r}")
        table = self._tables.setdefault(seq_id, [])
        self._lengths.setdefault(seq_id, 0)
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > len(self._free):
            if not table:
                del self._tables[seq_id], self._lengths[seq_id]
            raise ValueError(
                f"KV cache pool exhausted: sequence {seq_id!r} needs {missing} more blocks, "
                f"{len(self._free)} free; the scheduler must wait or preempt (check can_grow first)"
            )
        table.extend(self._free.pop() for _ in range(max(missing, 0)))
        self._lengths[seq_id] = max(self._lengths[seq_id], num_tokens)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` slots (speculative rollback); free the blocks beyond."""
        length = self.num_tokens(seq_id)
        if not 0 <= num_tokens <= length:
            raise ValueError(f"cannot truncate sequence {seq_id!r} of {length} tokens to {num_tokens}")
        table = self._tables[seq_id]
        keep = self.blocks_needed(num_tokens)
        self._free.extend(reversed(table[keep:]))
        del table[keep:]
        self._lengths[seq_id] = num_tokens

    def free(self, seq_id: Hashable) -> None:
        """Return all of ``seq_id``'s blocks to the pool (unknown ids are an error)."""
        self.num_tokens(seq_id)
        self._free.extend(reversed(self._tables.pop(seq_id)))
        del self._lengths[seq_id]

    def num_tokens(self, seq_id: Hashable) -> int:
        if seq_id not in self._lengths:
            raise ValueError(f"unknown sequence {seq_id!r}: it holds no cache blocks")
        return self._lengths[seq_id]

    def block_table(self, seq_id: Hashable) -> list[int]:
        self.num_tokens(seq_id)
        return list(self._tables[seq_id])

    def slot_mapping(self, seq_id: Hashable, start: int, end: int) -> Tensor:
        """(end - start,) int64 slots of token positions [start, end) of ``seq_id``."""
        return torch.tensor(self._slots(seq_id, start, end), dtype=torch.int64)

    def slots_of(self, spans: Sequence[tuple[Hashable, int, int]]) -> Tensor:
        """Slots of several (seq_id, start, end) spans, concatenated: (sum of end - start,) int64."""
        return torch.tensor(self._slot_list(spans), dtype=torch.int64)

    def slot_index(self, spans: Sequence[tuple[Hashable, int, int]]) -> Tensor | slice:
        """``slots_of(spans)`` as a cache write indexes with: a slice when the slots are consecutive
        (a decode row, or tokens within one block), else the (sum of end - start,) int64 tensor."""
        slots = self._slot_list(spans)
        if slots and slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, dtype=torch.int64)

    def _slot_list(self, spans: Sequence[tuple[Hashable, int, int]]) -> list[int]:
        return [slot for span in spans for slot in self._slots(*span)]

    def _slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        if not 0 <= start <= end <= self.num_tokens(seq_id):
            raise ValueError(
                f"positions [{start}, {end}) are outside sequence {seq_id!r} of "
                f"{self.num_tokens(seq_id)} slots; grow it first"
            )
        table, size = self._tables[seq_id], self.block_size
        # plain ints: a decode step maps one position per sequence, cheaper than tensor arithmetic
        return [table[pos // size] * size + pos % size for pos in range(start, end)]

    def batch_slots(self, seq_ids: Sequence[Hashable], lengths: Sequence[int] | None = None) -> BatchSlots:
        """Slots of the first ``lengths[i]`` tokens (default: all) of each sequence, padded to S_max."""
        lens = [self.num_tokens(s) for s in seq_ids] if lengths is None else list(lengths)
        for s, n in zip(seq_ids, lens, strict=True):
            if not 0 <= n <= self.num_tokens(s):
                raise ValueError(f"sequence {s!r} has {self.num_tokens(s)} slots, asked for {n}")
        s_max = max(lens, default=0)
        max_blocks = max(self.blocks_needed(s_max), 1)
        tables = tuple(tuple((self._tables[s][:max_blocks] + [0] * max_blocks)[:max_blocks]) for s in seq_ids)
        first = None
        if len(tables) == 1 and s_max:  # a lone sequence in consecutive blocks reads as one slice
            blocks = tables[0][: self.blocks_needed(s_max)]
            if blocks == tuple(range(blocks[0], blocks[0] + len(blocks))):
                first = blocks[0] * self.block_size
        return BatchSlots(tables, tuple(lens), self.block_size, first)
