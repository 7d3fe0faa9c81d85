"""The model runner: turns a batch of sequences into padded model inputs over the paged latent cache.

For every call it computes the batch's slots once (one block table serves all layers), gathers
each layer's latents as (B, S_max, L+R), runs the model with per-row positions, and writes the
new entries of the real (non-padding) tokens back into the cache. Decode and verification calls of
a model that ``accepts_room`` read the main layers from the resident buffer instead
(``mlaq.engine.resident``: gathered again only when the batch changes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.kv_cache import KVCacheDtype, LatentKVCache
from mlaq.engine.model_api import LatentLM, LMOutput
from mlaq.engine.resident import ResidentLatents
from mlaq.engine.sequence import Sequence as Seq


class ModelRunner:
    """Runs ``model`` for batches of ``Sequence``s; slots must already be allocated (the scheduler)."""

    def __init__(self, model: LatentLM, cache: LatentKVCache, blocks: BlockManager, *, use_mtp: bool) -> None:
        geometry = model.geometry
        need = geometry.num_layers + (1 if use_mtp else 0)  # the MTP layer only when speculating
        if cache.config.num_layers != need:
            raise ValueError(f"the KV cache has {cache.config.num_layers} layers, the model needs {need}")
        self.model = model
        self.cache = cache
        self.blocks = blocks
        c = cache.config
        plain = c.kv_cache_dtype is KVCacheDtype.AUTO and not any(c.extra_dims[: geometry.num_layers])
        # stored values are what the model computed (no fp8 rounding, no indexer columns): resident
        room = plain and getattr(model, "accepts_room", False)
        # float32 by default (the reference attention's matmuls read float32); a model may ask for another
        self.resident = ResidentLatents(getattr(model, "room_dtype", torch.float32)) if room else None

    def _inputs(self, token_lists: Sequence[Sequence[int]], starts: Sequence[int]) -> tuple[Tensor, Tensor]:
        t = max(len(tokens) for tokens in token_lists)
        # right-padded with each row's last token (a real id: padding outputs are discarded)
        rows = [list(tokens) + [tokens[-1]] * (t - len(tokens)) for tokens in token_lists]
        ids = torch.tensor(rows, dtype=torch.int64)  # (B, T)
        positions = torch.tensor([range(st, st + t) for st in starts], dtype=torch.int64)  # (B, T)
        return ids, positions

    def release(self) -> None:
        """Drop the resident buffer (the engine is idle); the paged cache refills it on the next call."""
        if self.resident is not None:
            self.resident.clear()

    def _store(
        self,
        seqs: Sequence[Seq],
        layers: Sequence[int],
        entries: Sequence[Tensor] | Tensor,
        lengths: Sequence[int],
        starts: Sequence[int],
    ) -> None:
        spans = [(s.seq_id, st, st + n) for s, st, n in zip(seqs, starts, lengths, strict=True)]
        slots = self.blocks.slot_index(spans)  # (sum T_b,) or a slice
        n_layers = entries.shape[0] if isinstance(entries, Tensor) else len(entries)
        b, t = entries.shape[1:3] if isinstance(entries, Tensor) else entries[0].shape[:2]
        no_padding = all(n == t for n in lengths)
        if isinstance(entries, Tensor) and no_padding and list(layers) == list(range(n_layers)):
            # entries stacked by the model as (layers, B, T, E): one write, no per-layer ops
            self.cache.write_layers(slots, entries.view(n_layers, b * t, -1))
            return
        if no_padding:  # (B, T, E) -> (B*T, E), row-major
            real = [entry.reshape(b * t, -1) for entry in entries]
        else:
            mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
            real = [entry[mask] for entry in entries]  # (B, T, E)[mask] -> (sum T_b, E), row-major
        if list(layers) == list(range(n_layers)):
            self.cache.write_layers(slots, real)
            return
        for layer, entry in zip(layers, real, strict=True):
            self.cache.write(layer, slots, entry)

    def forward(
        self,
        seqs: Sequence[Seq],
        token_lists: Sequence[Sequence[int]],
        *,
        prefill: bool,
        last_only: bool = False,
    ) -> LMOutput:
        """Main model over ``token_lists[b]``, placed after each sequence's ``num_cached`` tokens.

        ``last_only``: logits of each row's last token only, (B, 1, vocab)."""
        starts = [s.num_cached for s in seqs]
        ids, positions = self._inputs(token_lists, starts)
        seq_ids = [s.seq_id for s in seqs]
        layers = range(self.model.geometry.num_layers)
        lengths = [len(t) for t in token_lists]
        logits_index = _last_index(token_lists, last_only)

        def gather() -> Tensor:  # (layers, B, S_max, L+R); the block tables cost ~4 us a row: only when read
            return self.cache.gather_layers(len(layers), self.blocks.batch_slots(seq_ids, starts))

        if self.resident is not None and not prefill:
            room = self.resident.buffer(seq_ids, starts, ids.shape[1], gather)  # (layers, B, cap, L+R)
            past = room[:, :, : max(starts)]  # (layers, B, S_max, L+R)
            try:
                out = self.model.forward(
                    ids, positions, past, prefill=False, logits_index=logits_index, room=room
                )
            except BaseException:
                self.resident.clear()  # layers may have written part of the call: never reuse it
                raise
            self.resident.written([st + n for st, n in zip(starts, lengths, strict=True)])
        else:
            if self.resident is not None:
                self.resident.clear()  # a prefill writes the pages only
            past = gather()
            out = self.model.forward(ids, positions, past, prefill=prefill, logits_index=logits_index)
        self._store(seqs, layers, out.entries, lengths, starts)
        return out

    def mtp(
        self,
        seqs: Sequence[Seq],
        token_lists: Sequence[Sequence[int]],
        hidden: Sequence[Tensor],
        starts: Sequence[int],
        *,
        last_only: bool = False,
    ) -> LMOutput:
        """The MTP layer over ``token_lists[b]`` at positions ``starts[b]...`` with ``hidden[b]`` (T_b, H).

        Always the first MTP layer: checkpoints of this family ship one (``num_nextn_predict_layers``
        = 1) and chain it k times, as vLLM does. ``last_only`` as in ``forward``.
        """
        ids, positions = self._inputs(token_lists, starts)
        t = ids.shape[1]
        if all(x.shape[0] == t for x in hidden):
            h = torch.stack(tuple(hidden))  # (B, T, H)
        else:
            h = torch.zeros(len(seqs), t, hidden[0].shape[-1], dtype=hidden[0].dtype)  # (B, T, H)
            for row, x in enumerate(hidden):
                h[row, : x.shape[0]] = x
        layer = self.model.geometry.num_layers  # the MTP layer's cache index
        batch = self.blocks.batch_slots([s.seq_id for s in seqs], starts)
        past = self.cache.gather(layer, batch)[0]
        out = self.model.mtp(
            ids, h, positions, past, step=0, logits_index=_last_index(token_lists, last_only)
        )
        self._store(seqs, [layer], out.entries, [len(x) for x in token_lists], starts)
        return out


def _last_index(token_lists: Sequence[Sequence[int]], last_only: bool) -> Tensor | None:
    """(B,) index of each row's last real token, or None (all logits; also when T = 1 anyway)."""
    if not last_only or max(len(tokens) for tokens in token_lists) == 1:
        return None
    return torch.tensor([len(tokens) - 1 for tokens in token_lists], dtype=torch.int64)
