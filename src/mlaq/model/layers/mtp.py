"""DeepSeek-V3 multi-token prediction (MTP) layer (DeepSeek-V3 report §2.2; engines.md "MTP layer").

Stored as checkpoint layer ``num_hidden_layers + i``. For a token at position t with the target's hidden
state h_t (AFTER the target's final norm, as vLLM feeds it) and the next token x_{t+1}:
  x   = eh_proj(concat(enorm(embed(x_{t+1})), hnorm(h_t)))      # embedding first, then hidden: (B, T, 2H) -> H
  y   = decoder_layer(x)                                        # one full MLA + MoE layer, own latent cache
  p   = head(shared_head.norm(y))                               # logits for x_{t+2}
``embed`` is the layer's own ``embed_tokens`` and ``head`` its ``shared_head.head`` when the checkpoint
stores them (DeepSeek-V3 does), else the main model's. Chained drafting feeds ``y`` (before
shared_head.norm) back as the next step's hidden state, as vLLM's MTP proposer does.
vLLM additionally zeroes the embedding of tokens at position 0; mlaq follows the definition and does not.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from mlaq.model.config import ModelConfig
from mlaq.model.layers.cache import LatentCache
from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.linear import Embedding, Linear
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.norm import RMSNorm
from mlaq.model.layers.step import StepPositions


class SharedHead(nn.Module):
    """``shared_head.norm`` and, when the checkpoint stores one, ``shared_head.head``."""

    def __init__(
        self, cfg: ModelConfig, own_head: bool, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.head = Linear(h, cfg.vocab_size, bias=False, dtype=dtype, device=device) if own_head else None


class MTPLayer(DecoderLayer):
    """A decoder layer plus enorm, hnorm, eh_proj, shared_head (and optionally its own embed_tokens)."""

    def __init__(
        self,
        cfg: ModelConfig,
        mla_cfg: MLAConfig,
        layer: int,
        *,
        own_embed: bool,
        own_head: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(cfg, mla_cfg, layer, dtype=dtype, device=device)
        h = cfg.hidden_size
        kw = {"dtype": dtype, "device": device}
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.eh_proj = Linear(2 * h, h, bias=False, **kw)
        self.shared_head = SharedHead(cfg, own_head, **kw)
        self.embed_tokens = Embedding(cfg.vocab_size, h, **kw) if own_embed else None

    def predict(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        step: StepPositions,
        cache: LatentCache,
        path: AttnPath,
        main_embed: nn.Embedding,
        main_head: nn.Linear,
        logits_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """input_ids (B, T) = the tokens after those whose hidden states (B, T, H) are given, at the
        hidden states' positions ``step`` -> (logits (B, T, vocab) fp32, output hidden (B, T, H)).
        With ``logits_index`` (B,), logits only at that position of each row: (B, 1, vocab)."""
        x = self.combine(input_ids, hidden, main_embed)
        y, _, _ = self(x, step.positions, cache, path, step=step)
        return self.logits(y, main_head, logits_index), y

    def combine(self, input_ids: Tensor, hidden: Tensor, main_embed: nn.Embedding) -> Tensor:
        """The block's input: eh_proj of the normed embeddings of ``input_ids`` and normed ``hidden``."""
        embed = self.embed_tokens if self.embed_tokens is not None else main_embed
        e = self.enorm(embed(input_ids))  # (B, T, H)
        h = self.hnorm(hidden.to(e.dtype))  # (B, T, H)
        return self.eh_proj(torch.cat((e, h), dim=-1))  # (B, T, 2H) -> (B, T, H)

    def logits(self, y: Tensor, main_head: nn.Linear, logits_index: Tensor | None = None) -> Tensor:
        """The block's output (B, T, H) -> float32 logits through shared_head (B, T or 1, vocab)."""
        head = self.shared_head.head if self.shared_head.head is not None else main_head
        return head(self.shared_head.norm(select_rows(y, logits_index))).float()


def select_rows(x: Tensor, index: Tensor | None) -> Tensor:
    """x (B, T, H) -> x[b, index[b]] as (B, 1, H); all of x when ``index`` is None."""
    if index is None:
        return x
    if tuple(index.shape) != (x.shape[0],):
        raise ValueError(f"logits_index must have shape (B,) = ({x.shape[0]},), got {tuple(index.shape)}")
    return x[torch.arange(x.shape[0], device=x.device), index.to(x.device)][:, None]
