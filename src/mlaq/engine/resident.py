"""Decode-resident latents: the running batch's latent cache kept in one buffer between decode steps.

A decode step attends over every cached latent of every row. Gathering them from the paged pool at
each step copies the batch's whole history (batch 32 x 512 tokens x 4 layers x 576 bf16 values: 78 MB
a step), and appending the new token copies it again; on a 2-core VM whose copies run at ~9 GB/s that
was most of a batch-32 decode step (vLLM's kernels read the pages in place). So while the batch stays
the same, the runner keeps its main layers' latents in one buffer, (layers, B, capacity, L+R), rows in
batch order, and the model writes each call's new entries straight into it ("write, then read"): no
gather and no concatenation. The buffer holds float32 (the model dtype's values, exactly): the
absorbed path's score matmul multiplies float32 operands, so a bf16 buffer would need a float32 copy
per layer and step (at batch 32, 4-6 ms of a ~50 ms step); it costs twice the memory of the
batch's cache instead. A model may ask for another dtype (``room_dtype``): ``compile=True`` holds the
compute dtype, which its fused attention kernel reads in place. The paged cache stays the record (it
is written as before); the buffer is rebuilt from it by one gather whenever the batch changes, a row
would start past what the buffer holds for it, or the capacity is reached (it grows by a quarter
plus 64 positions).

Row b of the buffer holds the row's entries for positions below ``valid[b]``; later positions hold
zeros or entries of right-padded tokens (finite values that causality hides, as the gather's zeros).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

GROWTH_MIN = 64  # positions of room added beyond what a rebuild needs, at least


@dataclass
class _Batch:
    seq_ids: tuple[Hashable, ...]
    buffer: Tensor  # (layers, B, capacity, L+R)
    valid: list[int]  # per row, positions below this hold the row's real entries


class ResidentLatents:
    """The buffer of one runner (main layers only; the MTP layer is gathered per call as before)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        """``dtype``: the buffer's (float32; the model dtype gives the bf16 layout, for comparisons)."""
        self.dtype = dtype
        self._batch: _Batch | None = None

    def buffer(
        self,
        seq_ids: Sequence[Hashable],
        starts: Sequence[int],
        num_tokens: int,
        gather: Callable[[], Tensor],
    ) -> Tensor:
        """(layers, B, capacity, L+R), capacity >= max(starts) + num_tokens, whose rows hold their
        entries below ``starts[b]``; ``gather()`` (the paged cache's (layers, B, max(starts), L+R),
        zeros past each row's length) rebuilds it when it cannot serve this call."""
        need = max(starts) + num_tokens
        held = self._batch
        if (
            held is None
            or held.seq_ids != tuple(seq_ids)
            or held.buffer.shape[2] < need
            or any(s > v for s, v in zip(starts, held.valid, strict=True))
        ):
            self._batch = None  # a failed gather must not leave a stale buffer behind
            past = gather()  # (layers, B, S, L+R)
            n, b, s, width = past.shape
            capacity = need + max(need // 4, GROWTH_MIN)
            buf = torch.empty(n, b, capacity, width, dtype=self.dtype)
            buf[:, :, :s] = past
            buf[:, :, s:] = 0  # finite past every row's entries (the history is written once)
            held = _Batch(tuple(seq_ids), buf, list(starts))
            self._batch = held
        return held.buffer

    def written(self, ends: Sequence[int]) -> None:
        """After a call through :meth:`buffer`: row b now holds real entries below ``ends[b]`` (its start
        plus its real, not right-padded, tokens)."""
        assert self._batch is not None, "written() without buffer()"
        self._batch.valid = list(ends)

    def clear(self) -> None:
        """Forget the buffer (the paged cache was written another way, e.g. by a prefill)."""
        self._batch = None
