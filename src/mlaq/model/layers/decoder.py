"""One DeepSeek-V3-family decoder layer: RMSNorm -> MLA (+ DSA indexer) -> residual -> RMSNorm -> MLP/MoE.

Parameter names are Hugging Face's (``input_layernorm``, ``self_attn.*``, ``self_attn.indexer.*``,
``post_attention_layernorm``, ``mlp.*``), so a checkpoint's tensors map onto it one to one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mlaq.model.config import ModelConfig
from mlaq.model.layers.cache import LatentCache
from mlaq.model.layers.dsa import Indexer
from mlaq.model.layers.mla import AttnPath, MLAttention
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.moe import DenseMLP, MoE
from mlaq.model.layers.norm import RMSNorm
from mlaq.model.layers.rope import RopeTable
from mlaq.model.layers.step import StepPositions, from_positions
from mlaq.model.registry import IndexerKind, MlpKind


class DecoderLayer(nn.Module):
    """Layer ``layer`` of the checkpoint (an MTP layer's block too: see :class:`MTPLayer`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        mla_cfg: MLAConfig,
        layer: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.layer = layer
        h = cfg.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.self_attn = MLAttention(mla_cfg, **kw)
        self.indexer_kind = cfg.indexer_kind(layer)
        if self.indexer_kind is IndexerKind.FULL:
            assert cfg.indexer is not None and cfg.q_lora_rank is not None  # checked by ModelConfig
            # registered under self_attn so its parameters are named self_attn.indexer.* as on disk
            self.self_attn.indexer = Indexer(h, cfg.q_lora_rank, cfg.indexer, mla_cfg.rope, **kw)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        if cfg.mlp_kind(layer) is MlpKind.SPARSE:
            assert cfg.moe is not None
            self.mlp: nn.Module = MoE(h, cfg.moe, **kw)
        else:
            self.mlp = DenseMLP(h, cfg.intermediate_size, **kw)

    @property
    def indexer(self) -> Indexer | None:
        return getattr(self.self_attn, "indexer", None)

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        cache: LatentCache,
        path: AttnPath,
        shared_key_mask: Tensor | None = None,
        *,
        step: StepPositions | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """x (B, T, H) at positions (B, T) -> (output (B, T, H), the new cache entries (B, T, L+R),
        this layer's DSA key mask or None).

        The layer writes its new entries through ``cache.update``. ``step``: the positions' RoPE
        angles and causal mask, computed once per call by the model (built here when absent).
        ``shared_key_mask`` (B, T, K): the selection of the previous full-indexer layer, which a
        ``shared`` DSA layer reuses (GLM-5). Forward hooks see ``positions`` as ``args[1]``.
        """
        if step is None:
            step = from_positions(positions, RopeTable(self.self_attn.rope))
        h = self.input_layernorm(x)
        attn_out, entries, key_mask = self._attention(h, step, cache, path, shared_key_mask)
        x = x + attn_out
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, entries, key_mask

    def fill_cache(self, x: Tensor, step: StepPositions, cache: LatentCache) -> None:
        """Only write the new tokens' cache entries (latent, and DSA index keys where this layer has its
        own indexer), the values ``forward`` writes: for the last layer of a prefill whose outputs
        nobody reads (a decode that continues the cache reads only its entries). Skips the queries,
        the attention, the MLP/MoE and the indexer's scores."""
        h = self.input_layernorm(x)
        latent = self.self_attn.cache_entries(h, (step.cos, step.sin))
        indexer = self.indexer
        cache.update(self.layer, step, latent, None if indexer is None else indexer.keys(h, step.positions))

    def _attention(
        self,
        h: Tensor,
        step: StepPositions,
        cache: LatentCache,
        path: AttnPath,
        shared_key_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        attn = self.self_attn
        proj = attn.project(h, step.positions, (step.cos, step.sin))
        indexer = self.indexer
        new_index_keys = None if indexer is None else indexer.keys(h, step.positions)  # (B, T, D)
        # keys (B, K, L+R) by position: the cache with the new entries written at their positions
        keys, index_keys = cache.update(self.layer, step, proj.latent, new_index_keys)
        key_mask = None
        if indexer is not None:
            assert proj.q_latent is not None and index_keys is not None
            scores = indexer.scores(h, proj.q_latent, step.positions, index_keys)  # (B, T, K)
            key_mask = indexer.select(scores, step.visible())
        elif self.indexer_kind is IndexerKind.SHARED:
            if shared_key_mask is None:
                raise ValueError(f"layer {self.layer} shares DSA top-k but no earlier layer computed one")
            key_mask = shared_key_mask
        causal = step.causal and key_mask is None  # known here: the naive path need not check the mask
        out = attn.attend(proj.q_nope, proj.q_pe, keys, step.with_key_mask(key_mask), path, causal=causal)
        return out, proj.latent, key_mask
