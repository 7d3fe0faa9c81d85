"""mlaq's DeepSeek-family models behind the engine's ``LatentLM`` contract, and checkpoint loading.

The adapter calls the model's own forward / ``mtp_step`` with per-row positions and a
:class:`GatheredCache`: the engine's gathered latents of the call, into which each layer writes its
new entries (and from which the engine then stores them in its paged cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mlaq.engine.model_api import CacheGeometry, LatentLM, LMOutput
from mlaq.engine.tokenizer import Tokenizer
from mlaq.model import AttnPath, DeepseekForCausalLM, load_model
from mlaq.model.layers.step import StepPositions
from mlaq.policy import ExplicitConfig


class DeepseekLatentLM:
    """``LatentLM`` over a loaded :class:`DeepseekForCausalLM` (any supported ``model_type``).

    ``forward`` also takes ``room``: the runner's resident buffer (``mlaq.engine.resident``), into
    which the layers write their new entries instead of concatenating them to ``past``."""

    accepts_room = True  # the runner may pass ``room`` to ``forward``

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.model = model
        mla = model.mla_config
        extra = []
        for layer in model.model.layers:
            indexer = layer.indexer
            extra.append(indexer.cfg.head_dim if indexer is not None else 0)
        self._latent_width = mla.kv_lora_rank + mla.qk_rope_head_dim
        self._geometry = CacheGeometry(
            model.config.num_hidden_layers,
            model.num_mtp_layers,
            mla.kv_lora_rank,
            mla.qk_rope_head_dim,
            model.dtype,
            tuple(extra),
        )

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Sequence[Tensor],
        *,
        prefill: bool,
        logits_index: Tensor | None = None,
        room: Tensor | None = None,
    ) -> LMOutput:
        """``room`` (layers, B, capacity, L+R), capacity >= S + T: a buffer whose first S positions
        ``past`` views; each layer writes its new entries there and attends over its first K."""
        cache = GatheredCache(past, self._latent_width, first_layer=0, room=room)
        path = AttnPath.NAIVE if prefill else AttnPath.ABSORBED
        out = self.model(input_ids, cache, path=path, positions=positions, logits_index=logits_index)
        return LMOutput(out.logits, out.hidden, tuple(cache.entries))

    @torch.no_grad()
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
        m = self.model
        index = m.config.num_hidden_layers + step % m.num_mtp_layers
        cache = GatheredCache([past], self._latent_width, first_layer=index)
        out = m.mtp_step(input_ids, hidden, cache, step=step, positions=positions, logits_index=logits_index)
        return LMOutput(out.logits, out.hidden, tuple(cache.entries))


class GatheredCache:
    """A ``LatentCache`` over one engine call: ``past[i]`` (B, S, L+R [+ D]) holds layer
    ``first_layer + i``'s cached entries of each row (real below the row's start position). Each
    ``update`` appends the layer's new entries (B, T, L+R [+ D]) to ``entries``. With ``room``
    (see ``DeepseekLatentLM.forward``) the keys are written into ``room[i]`` and read back from it."""

    def __init__(
        self, past: Sequence[Tensor], latent_width: int, *, first_layer: int, room: Tensor | None = None
    ) -> None:
        self.past = past
        self.width = latent_width  # L + R; DSA indexer keys ride along after it
        self.first_layer = first_layer
        self.room = room
        self.entries: list[Tensor] = []

    def update(
        self, layer: int, step: StepPositions, latent: Tensor, index_keys: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        entry = latent if index_keys is None else torch.cat((latent, index_keys), dim=-1)  # (B, T, E)
        self.entries.append(entry)
        past = self.past[layer - self.first_layer]  # (B, S, E)
        b, s, e = past.shape
        if self.room is not None:  # write, then read, in place: no copy of the history
            buf = self.room[layer - self.first_layer]  # (B, capacity, E), its first S positions = past
            if step.uniform:  # narrow + copy_: a few us against ~10 for a sliced assignment
                buf.narrow(1, step.starts[0], entry.shape[1]).copy_(entry)
            else:
                buf.scatter_(1, step.positions[:, :, None].expand(-1, -1, e), entry.to(buf.dtype))
            keys = buf.narrow(1, 0, step.num_keys)  # (B, K, E); past a row's new tokens: hidden by causality
        elif step.uniform and step.starts[0] == s:  # every row continues at S: append
            keys = torch.cat((past, entry), dim=1) if s else entry  # (B, K, E)
        else:  # rows at different positions: write each row's entries at its own positions
            keys = entry.new_zeros(b, step.num_keys, e)
            n = min(s, step.num_keys)
            keys[:, :n] = past[:, :n]
            keys.scatter_(1, step.positions[:, :, None].expand(-1, -1, e), entry)
        if index_keys is None:
            return keys, None
        return keys[..., : self.width], keys[..., self.width :]


@dataclass(frozen=True)
class LoadedModel:
    model: LatentLM
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def load_latent_lm(
    path: Path, *, dtype: torch.dtype | None = None, quantization_config: str | ExplicitConfig | None = None
) -> LoadedModel:
    """Load a checkpoint directory: the model (policy applied), tokenizer.json if present, EOS ids."""
    model = load_model(path, dtype=dtype, quantization_config=quantization_config)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    eos = model.config.hf.get("eos_token_id")
    eos_ids = tokenizer.eos_token_ids if tokenizer is not None else ()
    if not eos_ids:
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,) if isinstance(eos, int) else ()
    return LoadedModel(
        DeepseekLatentLM(model), tokenizer, tuple(eos_ids), model.config.max_position_embeddings
    )
