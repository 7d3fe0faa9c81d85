"""What the engine needs from a model: a causal LM over a per-layer latent cache, plus an MTP step.

The engine owns the cache (paged, in ``kv_cache``) and hands the model, per call, the gathered
latents of every layer; the model returns the new tokens' cache entries and the engine stores
them. Rows of a batch may sit at different positions: row b's new tokens are at ``positions[b]``
(consecutive), and ``past[i][b, j]`` is a real entry exactly for ``j < positions[b, 0]``; entries
beyond are padding. The model must therefore see key j from a query at position p iff j <= p,
after writing the new entries at their positions ("write, then read"); causality then hides the
padding. Right-padded input tokens (T_b < T) sit after a row's real tokens: their outputs are
ignored and their entries are not stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class LMOutput:
    """One forward pass over (B, T) tokens."""

    logits: Tensor  # (B, T, vocab) float32
    hidden: Tensor  # (B, T, H): what the MTP layer consumes (main model) / chains on (MTP)
    # per cache layer written by the call: (B, T, L+R [+ D]) each, or stacked (layers, B, T, L+R)
    entries: tuple[Tensor, ...] | Tensor


@dataclass(frozen=True)
class CacheGeometry:
    """The latent cache a model needs: ``num_layers`` main layers then ``num_mtp_layers`` MTP layers."""

    num_layers: int
    num_mtp_layers: int
    kv_lora_rank: int  # L
    qk_rope_head_dim: int  # R
    dtype: torch.dtype
    extra_dims: tuple[int, ...] = ()  # per cache layer (main, then MTP): DSA indexer-key width, or 0

    def extra_dim(self, layer: int) -> int:
        return self.extra_dims[layer] if self.extra_dims else 0

    @property
    def num_cache_layers(self) -> int:
        return self.num_layers + self.num_mtp_layers


class LatentLM(Protocol):
    """The model contract of the engine (``mlaq.engine.adapter`` wraps mlaq's DeepSeek models).

    Optional: a model whose ``accepts_room`` is True also takes ``room=`` in absorbed-path ``forward``
    calls, the runner's resident buffer (``mlaq.engine.resident``) that ``past`` views; it writes the
    new entries there and reads the keys back from it (``mlaq.engine.adapter.GatheredCache``); its
    optional ``room_dtype`` (default float32) is the dtype that buffer holds."""

    @property
    def geometry(self) -> CacheGeometry: ...

    @property
    def vocab_size(self) -> int: ...

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Sequence[Tensor],
        *,
        prefill: bool,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        """Main layers over input_ids (B, T) at positions (B, T); past[i]: (B, S, L+R) of layer i.

        prefill=True runs MLA's naive path (prompts), False the absorbed path (decode, verification).
        ``entries`` has one tensor per main layer. ``logits_index`` (B,): compute logits only at
        position ``logits_index[b]`` of row b, (B, 1, vocab) (a prompt needs its last token's only);
        ``hidden`` and ``entries`` stay complete.
        """
        ...

    def mtp(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past: Tensor,
        *,
        step: int,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        """MTP layer ``step``: input_ids (B, T) are the tokens after those whose hidden states (B, T, H)
        are given, at those hidden states' positions (B, T); past: (B, S, L+R) of that MTP layer.
        Logits predict the token after each input token (only at ``logits_index``, as in
        ``forward``); ``entries`` has one tensor."""
        ...
