"""The DeepSeek-V3-family causal LM: embeddings, decoder layers, final norm, lm_head, MTP layers.

One class serves every supported ``model_type`` (see registry); the config decides the parts. Inputs
are token ids (B, T); by default row b continues its own cache (ModelCache keeps per-row lengths)::

    out = model.prefill(ids, cache)           # naive MLA (prefill), cache: ModelCache filled in place
    out = model.decode(next_ids, cache)       # absorbed MLA, T >= 1 new tokens (decode, verification)
    mtp = model.mtp_step(draft_in, out.hidden[:, -1:], cache)   # MTP logits for the token after next

``positions`` (B, T) places rows explicitly (consecutive per row, starting at most at the row's cached
length: an earlier start overwrites, e.g. after right-padding or rejected drafts); any
:class:`~mlaq.model.layers.cache.LatentCache` (the engine's paged cache) works then.

Logits are float32 (B, T, vocab); ``hidden`` is the final hidden state after ``model.norm`` (what the
MTP layer consumes, vLLM's convention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from mlaq.model.config import ModelConfig
from mlaq.model.layers.cache import LatentCache, ModelCache
from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.linear import Embedding, Linear
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.mtp import MTPLayer, select_rows
from mlaq.model.layers.norm import RMSNorm
from mlaq.model.layers.rope import RopeTable
from mlaq.model.layers.step import StepPositions, from_positions, step_positions


@dataclass(frozen=True)
class CausalLMOutput:
    logits: Tensor  # (B, T, vocab) float32
    hidden: Tensor  # (B, T, H): after model.norm for the main model; before shared_head.norm for MTP


class DeepseekModel(nn.Module):
    """``model.*``: embed_tokens, layers (main then MTP, checkpoint indices), norm."""

    def __init__(
        self,
        cfg: ModelConfig,
        mla_cfg: MLAConfig,
        *,
        num_mtp_layers: int,
        mtp_own_embed: bool,
        mtp_own_head: bool,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"dtype": dtype, "device": device}
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, **kw)
        n = cfg.num_hidden_layers
        layers: list[DecoderLayer] = [DecoderLayer(cfg, mla_cfg, i, **kw) for i in range(n)]
        layers += [
            MTPLayer(cfg, mla_cfg, n + i, own_embed=mtp_own_embed, own_head=mtp_own_head, **kw)
            for i in range(num_mtp_layers)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class DeepseekForCausalLM(nn.Module):
    """Build with :func:`mlaq.model.load_model`; constructing it directly gives unloaded weights."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        num_mtp_layers: int | None = None,
        mtp_own_embed: bool = False,
        mtp_own_head: bool = False,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.mla_config = MLAConfig.from_hf(cfg.hf)
        n_mtp = cfg.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
        self.model = DeepseekModel(
            cfg,
            self.mla_config,
            num_mtp_layers=n_mtp,
            mtp_own_embed=mtp_own_embed,
            mtp_own_head=mtp_own_head,
            dtype=dtype,
            device=device,
        )
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        self.bmm_decisions: tuple[Any, ...] = ()  # policy LayerDecisions, one per MLA layer (load_model)
        self.policy: Any = None  # the PolicyResult they came from
        self.tensor_parallel_size = 1  # the ranks whose head shards the BMM scales were computed over
        self.rope_table = RopeTable(self.mla_config.rope)  # cos/sin once per device, shared by all layers
        self._main_layers = tuple(
            self.model.layers[: cfg.num_hidden_layers]
        )  # no ModuleList slicing per call

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    @property
    def num_mtp_layers(self) -> int:
        return len(self.model.layers) - self.config.num_hidden_layers

    def step_positions(
        self, input_ids: Tensor, cache: LatentCache, layer: int, positions: Tensor | None
    ) -> StepPositions:
        """Positions, RoPE angles and causal mask of one call, computed once for all its layers."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, T) token ids, got shape {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if positions is not None:
            if tuple(positions.shape) != (b, t):
                raise ValueError(f"positions {tuple(positions.shape)} must match input_ids {(b, t)}")
            return from_positions(positions.to(input_ids.device), self.rope_table)
        if not isinstance(cache, ModelCache):
            raise ValueError("give positions (B, T) when the cache is not a ModelCache")
        lengths = cache.lengths(layer) or (0,) * b
        if len(lengths) != b:
            raise ValueError(f"the cache holds {len(lengths)} rows but input_ids has {b}")
        return step_positions(lengths, t, self.rope_table, input_ids.device)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        cache: LatentCache | None = None,
        *,
        path: AttnPath,
        positions: Tensor | None = None,
        logits_index: Tensor | None = None,
    ) -> CausalLMOutput:
        """Run the main layers over ``input_ids`` (B, T), by default after each row's cached tokens.

        ``logits_index`` (B,): logits only at position ``logits_index[b]`` of row b, (B, 1, vocab)
        (generation needs a prompt's last token only; the lm_head is the costliest matmul)."""
        cache = ModelCache() if cache is None else cache
        step = self.step_positions(input_ids, cache, 0, positions)
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        key_mask = None  # the last full DSA layer's selection, reused by `shared` layers
        for layer in self._main_layers:
            x, _, mask = layer(x, step.positions, cache, path, key_mask, step=step)
            key_mask = mask if mask is not None else key_mask
        hidden = self.model.norm(x)
        return CausalLMOutput(self.lm_head(select_rows(hidden, logits_index)).float(), hidden)

    def prefill(
        self,
        input_ids: Tensor,
        cache: LatentCache | None = None,
        *,
        positions: Tensor | None = None,
        logits_index: Tensor | None = None,
    ) -> CausalLMOutput:
        """Naive MLA (decompressed keys/values), as engines run prompts."""
        return self(input_ids, cache, path=AttnPath.NAIVE, positions=positions, logits_index=logits_index)

    @torch.no_grad()
    def prefill_cache(
        self, input_ids: Tensor, cache: LatentCache, *, positions: Tensor | None = None
    ) -> None:
        """Fill ``cache`` with ``input_ids`` (B, T) as ``prefill`` does, for a decode that continues it,
        and compute nothing else: the last main layer writes its cache entries but skips its queries,
        attention and MLP/MoE, and the final norm and lm_head do not run (outputs nobody reads). The
        cache holds the same bits as after ``prefill``; the MTP layers' caches are not filled."""
        step = self.step_positions(input_ids, cache, 0, positions)
        x = self.model.embed_tokens(input_ids)  # (B, T, H)
        *body, last = self._main_layers
        key_mask = None
        for layer in body:
            x, _, mask = layer(x, step.positions, cache, AttnPath.NAIVE, key_mask, step=step)
            key_mask = mask if mask is not None else key_mask
        last.fill_cache(x, step, cache)

    def decode(
        self,
        input_ids: Tensor,
        cache: LatentCache,
        *,
        positions: Tensor | None = None,
        logits_index: Tensor | None = None,
    ) -> CausalLMOutput:
        """Absorbed MLA (the two BMMs, with the layer's BMM scheme) for T >= 1 new tokens."""
        return self(input_ids, cache, path=AttnPath.ABSORBED, positions=positions, logits_index=logits_index)

    @torch.no_grad()
    def mtp_step(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        cache: LatentCache,
        *,
        step: int = 0,
        path: AttnPath = AttnPath.ABSORBED,
        positions: Tensor | None = None,
        logits_index: Tensor | None = None,
    ) -> CausalLMOutput:
        """MTP layer ``step % num_mtp_layers``: tokens (B, T) following the tokens whose hidden states
        (B, T, H) are given, at the positions after that MTP layer's cached ones. Returns the logits of
        the token after each input token and the MTP hidden state (feed it back to chain drafts).
        ``positions`` (B, T): the hidden states' positions (default: after each row's cached ones);
        ``logits_index`` as in ``forward``."""
        if self.num_mtp_layers == 0:
            raise ValueError(
                "this model has no MTP layer loaded (num_nextn_predict_layers = 0 or no weights)"
            )
        layer = self.model.layers[self.config.num_hidden_layers + step % self.num_mtp_layers]
        assert isinstance(layer, MTPLayer)
        if tuple(hidden.shape[:2]) != tuple(input_ids.shape):
            raise ValueError(
                f"hidden {tuple(hidden.shape)} must match input_ids {tuple(input_ids.shape)} in (B, T)"
            )
        where = self.step_positions(input_ids, cache, layer.layer, positions)
        logits, y = layer.predict(
            input_ids, hidden, where, cache, path, self.model.embed_tokens, self.lm_head, logits_index
        )
        return CausalLMOutput(logits, y)
