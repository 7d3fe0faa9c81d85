"""The model's latent KV cache contract, and its simplest implementation (plain tensors by position).

Each MLA layer (main and MTP) keeps ``latent`` (B, S, L+R) = [c_kv | k_pe] by position, and DSA layers
with their own indexer also ``index_keys`` (B, S, D). Layers are keyed by their checkpoint index, so the
MTP layer ``num_hidden_layers + i`` has its own entry and its own lengths. Rows may hold different
lengths: row b holds real entries for positions 0..lengths[b]-1.

The model talks to any cache through :class:`LatentCache` (``update``: write the new entries at their
positions, return the keys to attend over); the engine implements it over its paged storage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from mlaq.model.layers.step import StepPositions


@dataclass(frozen=True)
class LayerCache:
    latent: Tensor  # (B, S, L+R)
    index_keys: Tensor | None = None  # (B, S, D): DSA indexer keys; None for layers without an indexer

    @property
    def length(self) -> int:
        return self.latent.shape[1]

    def truncate(self, length: int) -> LayerCache:
        keys = None if self.index_keys is None else self.index_keys[:, :length]
        return LayerCache(self.latent[:, :length], keys)


class LatentCache(Protocol):
    """What a decoder layer needs from a cache."""

    def update(
        self, layer: int, step: StepPositions, latent: Tensor, index_keys: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Write the new entries (B, T, L+R) [and (B, T, D)] at ``step.positions``; return the layer's
        keys (B, K, L+R) [and (B, K, D)] by position, K = ``step.num_keys`` ("write, then read").
        Keys of row b must be real for positions < starts[b]; causality hides anything later."""
        ...


@dataclass
class _Slot:
    latent: Tensor  # (B, capacity, L+R)
    index_keys: Tensor | None  # (B, capacity, D)
    lengths: list[int]  # (B,)


class ModelCache:
    """Latent caches of one batch, by layer index, in buffers that grow by doubling (amortized O(1)
    copies per token). ``get`` returns views of the first ``length(layer)`` positions: later calls
    write into the same buffers (clone what you want to keep)."""

    def __init__(self) -> None:
        self._layers: dict[int, _Slot] = {}

    def get(self, layer: int) -> LayerCache | None:
        slot = self._layers.get(layer)
        if slot is None:
            return None
        s = max(slot.lengths)
        keys = None if slot.index_keys is None else slot.index_keys[:, :s]
        return LayerCache(slot.latent[:, :s], keys)

    def set(self, layer: int, entry: LayerCache) -> None:
        keys = None if entry.index_keys is None else entry.index_keys.clone()  # updates write in place
        self._layers[layer] = _Slot(entry.latent.clone(), keys, [entry.length] * entry.latent.shape[0])

    def length(self, layer: int = 0) -> int:
        """The longest row's cached tokens in ``layer`` (0 if the layer has none)."""
        slot = self._layers.get(layer)
        return 0 if slot is None else max(slot.lengths)

    def lengths(self, layer: int = 0) -> tuple[int, ...] | None:
        """Cached tokens of each row in ``layer`` (None if the layer has none)."""
        slot = self._layers.get(layer)
        return None if slot is None else tuple(slot.lengths)

    def truncate(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Forget positions >= ``length`` (e.g. rejected speculative tokens) in ``layers`` (default all)."""
        if length < 0:
            raise ValueError(f"cannot truncate a cache to {length} tokens")
        for layer in list(self._layers) if layers is None else layers:
            if layer in self._layers:
                slot = self._layers[layer]
                slot.lengths = [min(n, length) for n in slot.lengths]

    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._layers))

    def hold_latents(self, dtype: torch.dtype) -> None:
        """Keep every layer's latents in ``dtype`` from here on: converted once now, later writes as they
        land (DSA indexer keys stay as they are). float32 over bf16 latents is exact, and the absorbed path
        takes float32 keys as holding their values (``MLAttention.attend``): where its GEMMs run in float32
        they then read the cache as it is instead of converting all of it at every call (several decodes
        from one prefill: the task suite)."""
        for slot in self._layers.values():
            slot.latent = slot.latent.to(dtype)

    def update(
        self, layer: int, step: StepPositions, latent: Tensor, index_keys: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        b, t, _ = latent.shape
        slot = self._layers.get(layer)
        lengths = [0] * b if slot is None else slot.lengths
        if len(lengths) != b:
            raise ValueError(f"layer {layer}: the cache holds {len(lengths)} rows, the input has {b}")
        gaps = [(row, s, n) for row, (s, n) in enumerate(zip(step.starts, lengths, strict=True)) if s > n]
        if gaps:
            row, s, n = gaps[0]
            raise ValueError(
                f"layer {layer}, row {row}: new tokens start at position {s} but only {n} are cached; "
                "positions must continue the cache (or overwrite its end)"
            )
        k = step.num_keys
        if slot is None:
            slot = _Slot(latent.new_zeros(b, k, latent.shape[2]), None, lengths)
            self._layers[layer] = slot
        if index_keys is None and slot.index_keys is not None:
            raise ValueError(f"layer {layer} caches DSA indexer keys, but none were given")
        if index_keys is not None and slot.index_keys is None:
            slot.index_keys = index_keys.new_zeros(b, slot.latent.shape[1], index_keys.shape[2])
        if slot.latent.shape[1] < k:  # grow by doubling: amortized O(1) copies per token
            slot.latent = _grown(slot.latent, max(k, 2 * slot.latent.shape[1]))
            if slot.index_keys is not None:
                slot.index_keys = _grown(slot.index_keys, slot.latent.shape[1])
        _write(slot.latent, step, latent)
        if index_keys is not None:
            assert slot.index_keys is not None
            _write(slot.index_keys, step, index_keys)
        slot.lengths = [s + t for s in step.starts]
        keys = None if slot.index_keys is None else slot.index_keys[:, :k]
        return slot.latent[:, :k], keys


def _grown(buf: Tensor, capacity: int) -> Tensor:
    out = buf.new_zeros(buf.shape[0], capacity, buf.shape[2])
    out[:, : buf.shape[1]] = buf
    return out


def _write(buf: Tensor, step: StepPositions, new: Tensor) -> None:
    """buf (B, capacity, C)[b, positions[b, t]] = new[b, t]."""
    if step.uniform:
        s = step.starts[0]
        buf[:, s : s + new.shape[1]] = new
    else:
        idx = step.positions[:, :, None].expand(-1, -1, new.shape[2])  # (B, T, C)
        buf.scatter_(1, idx, new.to(buf.dtype))
