"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2 / GLM-5): the lightning indexer.

Per layer, a small multi-head scorer rates every visible key for every query:
  q[h]  = RoPE(wq_b(q_latent))[h]                  (B, T, H_i, D)  q_latent = q_a_layernorm(q_a_proj(x))
  k     = RoPE(LayerNorm(wk(x)))                   (B, S, D)       one key per token, cached
  w[h]  = weights_proj(x)[h] / sqrt(H_i)           (B, T, H_i)     fp32
  I[t, s] = sum_h w[h] * relu(q[h] . k[s] / sqrt(D))
RoPE covers the first qk_rope_head_dim channels of D (half-split layout in DeepSeek-V3.2, interleaved in
GLM-5, as transformers computes them). The top ``index_topk`` keys by I among those the query may see
become the key mask of MLA; everything is computed in fp32, as transformers does. transformers omits
the reference's Hadamard rotation (orthogonal: dot products unchanged) and FP8 scoring, and so does mlaq.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mlaq.model.config import IndexerConfig
from mlaq.model.layers.rope import Rope, RopeLayout


class Indexer(nn.Module):
    """``self_attn.indexer``: wq_b, wk, k_norm (LayerNorm with bias, eps 1e-6), weights_proj."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        cfg: IndexerConfig,
        mla_rope: Rope,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if cfg.head_dim < mla_rope.dim:
            raise ValueError(f"index_head_dim={cfg.head_dim} is smaller than qk_rope_head_dim={mla_rope.dim}")
        self.cfg = cfg
        kw = {"dtype": dtype, "device": device, "bias": False}
        self.wq_b = nn.Linear(q_lora_rank, cfg.n_heads * cfg.head_dim, **kw)
        self.wk = nn.Linear(hidden_size, cfg.head_dim, **kw)
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.weights_proj = nn.Linear(hidden_size, cfg.n_heads, **kw)
        layout = RopeLayout.INTERLEAVED if cfg.rope_interleave else RopeLayout.HALF_SPLIT
        self.rope = dataclasses.replace(mla_rope, layout=layout)  # same frequencies (and YaRN) as MLA

    def _rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """RoPE on the first R channels of x (B, T, [H,] D) at positions (B, T)."""
        r = self.rope.dim
        cos, sin = self.rope.cos_sin(positions)  # (B, T, R/2)
        if x.dim() == 4:
            cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        rot, rest = x.split([r, x.shape[-1] - r], dim=-1)
        return torch.cat((self.rope.apply(rot, cos, sin), rest), dim=-1)

    def keys(self, hidden: Tensor, positions: Tensor) -> Tensor:
        """The new tokens' index keys (B, T, D), the entries of this layer's index-key cache."""
        return self._rotate(self.k_norm(self.wk(hidden)), positions)

    def scores(self, hidden: Tensor, q_latent: Tensor, positions: Tensor, keys: Tensor) -> Tensor:
        """Index scores I (B, T, S) fp32 of the new queries against all index keys (B, S, D)."""
        b, t, _ = hidden.shape
        q = self.wq_b(q_latent).view(b, t, self.cfg.n_heads, self.cfg.head_dim)  # (B, T, Hi, D)
        q = self._rotate(q, positions)
        logits = torch.einsum("bthd,bsd->bths", q.float(), keys.float()) * self.cfg.head_dim**-0.5
        w = F.linear(hidden.float(), self.weights_proj.weight.float()) * self.cfg.n_heads**-0.5  # (B, T, Hi)
        return torch.einsum("bth,bths->bts", w, F.relu(logits))  # (B, T, S)

    def select(self, scores: Tensor, visible: Tensor) -> Tensor:
        """Key mask (B, T, S) bool: the top ``index_topk`` visible keys of each query (all if fewer)."""
        k = min(self.cfg.topk, scores.shape[-1])
        top = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices  # (B, T, k)
        keep = torch.zeros_like(visible).scatter_(-1, top, True)
        return keep & visible
