"""The simplest latent KV cache: per layer, plain tensors indexed by position.

Each MLA layer (main and MTP) keeps ``latent`` (B, S, L+R) = [c_kv | k_pe] for positions 0..S-1 of every
row, and DSA layers with their own indexer also ``index_keys`` (B, S, D). Every row of a batch holds the
same positions (no padding, no paging: the engine adds those). Layers are keyed by their checkpoint index,
so the MTP layer ``num_hidden_layers + i`` has its own entry and its own length.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import Tensor


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


class ModelCache:
    """Latent caches of one batch, by layer index. ``length(layer)`` tokens are cached in that layer."""

    def __init__(self) -> None:
        self._layers: dict[int, LayerCache] = {}

    def get(self, layer: int) -> LayerCache | None:
        return self._layers.get(layer)

    def set(self, layer: int, entry: LayerCache) -> None:
        self._layers[layer] = entry

    def length(self, layer: int = 0) -> int:
        entry = self._layers.get(layer)
        return 0 if entry is None else entry.length

    def truncate(self, length: int, layers: Iterable[int] | None = None) -> None:
        """Forget positions >= ``length`` (e.g. rejected speculative tokens) in ``layers`` (default all)."""
        if length < 0:
            raise ValueError(f"cannot truncate a cache to {length} tokens")
        for layer in list(self._layers) if layers is None else layers:
            if layer in self._layers:
                self._layers[layer] = self._layers[layer].truncate(length)

    def layers(self) -> tuple[int, ...]:
        return tuple(sorted(self._layers))
