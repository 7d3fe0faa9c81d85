"""mlaq's DeepSeek-family models behind the engine's ``LatentLM`` contract, and checkpoint loading.

``DeepseekForCausalLM.forward`` places every row of a batch at the same positions (its
``ModelCache`` is unpaged); the engine batches sequences of different lengths, so this adapter
runs the model's own modules (embed_tokens, decoder layers with their DSA key-mask hand-over,
norm, lm_head; ``MTPLayer.predict``) with per-row positions. The decoder layers already write new
entries at their positions and mask keys causally by position, which is what the contract needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mlaq.engine.model_api import CacheGeometry, LatentLM, LMOutput
from mlaq.engine.tokenizer import Tokenizer
from mlaq.model import AttnPath, DeepseekForCausalLM, LayerCache, load_model


class DeepseekLatentLM:
    """``LatentLM`` over a loaded :class:`DeepseekForCausalLM` (any supported ``model_type``)."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.model = model
        mla = model.mla_config
        extra = []
        for layer in model.model.layers:
            indexer = layer.indexer
            extra.append(indexer.cfg.head_dim if indexer is not None else 0)
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

    def _layer_cache(self, layer: int, past: Tensor) -> LayerCache | None:
        if past.shape[1] == 0:
            return None
        width = self._geometry.kv_lora_rank + self._geometry.qk_rope_head_dim
        index_keys = past[:, :, width:] if self._geometry.extra_dim(layer) else None
        return LayerCache(past[:, :, :width], index_keys)

    @staticmethod
    def _new_entries(cache: LayerCache, positions: Tensor) -> Tensor:
        """The new tokens' entries out of a position-indexed LayerCache: (B, T, L+R [+ D])."""
        parts = [cache.latent] if cache.index_keys is None else [cache.latent, cache.index_keys]
        idx = positions[:, :, None]  # (B, T, 1)
        return torch.cat([p.gather(1, idx.expand(-1, -1, p.shape[-1])) for p in parts], dim=-1)

    @torch.no_grad()
    def forward(
        self, input_ids: Tensor, positions: Tensor, past: Sequence[Tensor], *, prefill: bool
    ) -> LMOutput:
        m = self.model
        path = AttnPath.NAIVE if prefill else AttnPath.ABSORBED
        x = m.model.embed_tokens(input_ids)  # (B, T, H)
        key_mask = None  # the last full DSA layer's selection, reused by `shared` layers
        entries = []
        for i, layer in enumerate(m.model.layers[: m.config.num_hidden_layers]):
            x, cache, mask = layer(x, positions, self._layer_cache(i, past[i]), path, key_mask)
            key_mask = mask if mask is not None else key_mask
            entries.append(self._new_entries(cache, positions))
        hidden = m.model.norm(x)
        return LMOutput(m.lm_head(hidden).float(), hidden, tuple(entries))

    @torch.no_grad()
    def mtp(
        self, input_ids: Tensor, hidden: Tensor, positions: Tensor, past: Tensor, *, step: int
    ) -> LMOutput:
        m = self.model
        index = m.config.num_hidden_layers + step % m.num_mtp_layers
        layer = m.model.layers[index]
        logits, y, cache = layer.predict(
            input_ids,
            hidden,
            positions,
            self._layer_cache(index, past),
            AttnPath.ABSORBED,
            m.model.embed_tokens,
            m.lm_head,
        )
        return LMOutput(logits, y, (self._new_entries(cache, positions),))


@dataclass(frozen=True)
class LoadedModel:
    model: LatentLM
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


def load_latent_lm(
    path: Path, *, dtype: torch.dtype | None = None, quantization_config: str | None = None
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
