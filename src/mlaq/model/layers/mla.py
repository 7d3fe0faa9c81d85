"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7/5) with naive and absorbed paths.

Parameters carry Hugging Face names, so ``load_state_dict`` of a checkpoint's ``model.layers.i.self_attn.*``
works (DSA indexer weights aside). Typical use::

    attn = MLAttention(MLAConfig.from_hf(config_json))
    attn.load_state_dict(weights)                    # HF names
    attn.prepare("bf16", Precision.DECODE_ONLY)      # split kv_b_proj once, prepare W_UK / W_UV
    out, entries = attn(hidden, positions)           # prefill, naive path; store ``entries`` in the cache
    out, entries = attn(hidden1, positions1, cache, cache_lens, path=AttnPath.ABSORBED)   # decode

The latent cache row b holds [c_kv | k_pe] for positions 0..cache_lens[b]-1; the new tokens sit at
``positions``. A query at position p sees cached and new keys at positions <= p (and, if given, where
``key_mask`` is True). Shorter rows of a batch are right-padded: give pad tokens positions after the row's
last real token; their outputs are meaningless and their entries must not be stored.
Prepared BMM weights are plain attributes, not buffers: move the layer (``.to``) before ``prepare``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.bmm.registry import get_scheme
from mlaq.model.layers.linear import Linear, linear
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.mla_core import (
    AbsorbedWeights,
    Precision,
    absorbed_attention,
    assemble_keys,
    attention_mask,
    check_cache,
    naive_attention,
)
from mlaq.model.layers.mla_weights import checked_absorbed, installed_absorbed, prepare_absorbed
from mlaq.model.layers.norm import RMSNorm
from mlaq.model.layers.rope import expand_cos_sin, rotate

if TYPE_CHECKING:
    from mlaq.model.kernels.mla_kernel import MlaKernel

__all__ = [
    "AbsorbedWeights",
    "AttnPath",
    "MLAConfig",
    "MLAProjection",
    "MLAttention",
    "Precision",
    "assemble_keys",
    "attention_mask",
]


class AttnPath(Enum):
    NAIVE = "naive"  # decompress the latent cache (prefill)
    ABSORBED = "absorbed"  # two BMMs against the latent cache (decode, MTP verification)


@dataclass(frozen=True)
class MLAProjection:
    """The new tokens' projections, in the compute dtype."""

    q_nope: Tensor  # (B, T, N, P)
    q_pe: Tensor  # (B, T, N, R), rotated
    latent: Tensor  # (B, T, L+R): the cache entries [c_kv | k_pe], k_pe rotated
    q_latent: Tensor | None  # (B, T, Q): q_a_layernorm(q_a_proj(x)), the DSA indexer's input; None w/o q_lora


class MLAttention(nn.Module):
    """One MLA layer. Computes in its parameters' dtype (float32 by default; bf16 allowed)."""

    def __init__(self, config: MLAConfig, *, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        c = config
        self.config = c
        kw = {"dtype": dtype, "device": device}
        n, qk = c.num_heads, c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, n * qk, bias=False, **kw)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.latent_norm_eps, **kw)
            self.q_b_proj = Linear(c.q_lora_rank, n * qk, bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.latent_dim, bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.latent_norm_eps, **kw)
        self.kv_b_proj = Linear(c.kv_lora_rank, n * (c.qk_nope_head_dim + c.v_head_dim), bias=False, **kw)
        self.o_proj = Linear(n * c.v_head_dim, c.hidden_size, bias=c.attention_bias, **kw)
        self.rope = c.rope
        self.softmax_scale = c.softmax_scale  # computed once (a property of the config)
        self._absorbed: AbsorbedWeights | None = None  # plain attribute: not in state_dict
        # causal prefill (naive path) in mlaq's C kernel instead of torch's (``compile=True`` sets it)
        self.prefill_kernel: MlaKernel | None = None
        # vLLM's meaning of targets (--quantization online): prefill's kv_b_proj is an online-quantized
        # linear, activations quantized as the engine's kernel does (mlaq.model.loading.online)
        self.kv_b_online: Callable[[Tensor], Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.kv_a_proj_with_mqa.weight.dtype

    @property
    def absorbed(self) -> AbsorbedWeights | None:
        """The prepared BMM weights, or None before ``prepare`` / ``set_absorbed``."""
        return self._absorbed

    # ---- absorbed weights -------------------------------------------------------------------------
    def prepare(self, scheme: BmmScheme | str, precision: Precision = Precision.DECODE_ONLY) -> None:
        """Split kv_b_proj into W_UK (N, P, L) and W_UV^T (N, L, V) and quantize both with ``scheme``.

        Call after the weights are loaded; calling it again re-prepares. Changing kv_b_proj afterwards
        makes the absorbed path refuse to run until ``prepare`` is called again.
        """
        sch = get_scheme(scheme) if isinstance(scheme, str) else scheme
        self._absorbed = prepare_absorbed(self.config, self.kv_b_proj.weight.detach(), sch, precision)

    def set_absorbed(
        self,
        w_uk: PreparedWeight,
        w_uv: PreparedWeight,
        scheme: BmmScheme,
        *,
        scheme_uv: BmmScheme | None = None,
        precision: Precision = Precision.DECODE_ONLY,
    ) -> None:
        """Install already-prepared BMM weights (e.g. built from a checkpoint's FP8 codes and scales):
        ``w_uk`` of shape (N, P, L) for ``scheme``, ``w_uv`` = W_UV^T of shape (N, L, V) for ``scheme_uv``
        (default: ``scheme``). kv_b_proj.weight is then used only by the naive path under DECODE_ONLY."""
        self._absorbed = installed_absorbed(self.config, w_uk, w_uv, scheme, scheme_uv, precision)

    def _checked_absorbed(self) -> AbsorbedWeights:
        return checked_absorbed(self._absorbed, self.kv_b_proj.weight)

    def naive_kv_b(self) -> Tensor:
        """The (N*(P+V), L) weight the naive path decompresses with, in the compute dtype."""
        ab = self._absorbed
        if ab is not None and ab.precision is Precision.CONSISTENT:
            return self._checked_absorbed().kv_b_weight().to(self.dtype)
        return self.kv_b_proj.weight

    # ---- forward ----------------------------------------------------------------------------------
    def project(
        self,
        hidden: Tensor,
        positions: Tensor,
        rotation: tuple[Tensor, Tensor] | None = None,
        qkv_a: Tensor | None = None,
    ) -> MLAProjection:
        """hidden (B, T, H), positions (B, T) ints -> queries and the new latent-cache entries.

        ``rotation``: the per-channel RoPE cos / signed sin of ``positions`` (B, T, R) each
        (``RopeTable.rotation``), when the caller computed them once for all layers. ``qkv_a``:
        q_a_proj's and kv_a_proj_with_mqa's weights stacked (``linear.fuse_rows``; vLLM's
        ``fused_qkv_a_proj``): both projections of ``hidden`` in one GEMM (``compile=True``'s pieces)."""
        c = self.config
        if hidden.dim() != 3 or hidden.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden must be (B, T, H={c.hidden_size}), got {tuple(hidden.shape)}")
        if hidden.dtype != self.dtype:
            raise ValueError(
                f"hidden is {hidden.dtype} but the layer computes in {self.dtype}; cast it first"
            )
        if tuple(positions.shape) != tuple(hidden.shape[:2]) or positions.is_floating_point():
            raise ValueError(
                f"positions must be integer (B, T) = {tuple(hidden.shape[:2])}, "
                f"got {positions.dtype} {tuple(positions.shape)}"
            )
        b, t, _ = hidden.shape
        q_latent, kv = None, None
        if c.q_lora_rank is None:
            q = self.q_proj(hidden)  # (B, T, N*(P+R))
        else:
            if qkv_a is None:
                q_a = self.q_a_proj(hidden)  # (B, T, Q)
            else:
                q_a, kv = linear(hidden, qkv_a).split([c.q_lora_rank, c.latent_dim], dim=-1)
            q_latent = self.q_a_layernorm(q_a)  # (B, T, Q)
            q = self.q_b_proj(q_latent)  # (B, T, N*(P+R))
        q = q.view(b, t, c.num_heads, c.qk_head_dim)  # (B, T, N, P+R)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        if kv is None:
            kv = self.kv_a_proj_with_mqa(hidden)  # (B, T, L+R)
        c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # (B, T, L), (B, T, R)
        if rotation is None:
            cos, sin = expand_cos_sin(*self.rope.cos_sin(positions), self.rope.layout)  # (B, T, R) each
        else:
            cos, sin = rotation
        # one rotation for the N query heads and the single rope key shared by all heads
        pe = torch.cat((q_pe, k_pe[:, :, None, :]), dim=2)  # (B, T, N+1, R)
        pe = rotate(pe, cos[:, :, None, :], sin[:, :, None, :], self.rope.layout)
        q_pe, k_pe = pe[:, :, : c.num_heads], pe[:, :, c.num_heads]  # (B, T, N, R), (B, T, R)
        latent = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # (B, T, L+R)
        return MLAProjection(q_nope, q_pe, latent, q_latent)

    def cache_entries(self, hidden: Tensor, rotation: tuple[Tensor, Tensor]) -> Tensor:
        """The new tokens' latent-cache entries (B, T, L+R) only, the same values as ``project``'s
        ``latent`` (the same operations; RoPE is elementwise, so rotating k_pe without the queries
        changes no bit): for tokens whose queries nobody reads. ``rotation`` as in ``project``."""
        c = self.config
        kv = self.kv_a_proj_with_mqa(hidden)  # (B, T, L+R)
        c_kv, k_pe = kv.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)  # (B, T, L), (B, T, R)
        k_pe = rotate(k_pe, *rotation, self.rope.layout)  # (B, T, R)
        return torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)  # (B, T, L+R)

    def attend(
        self,
        q_nope: Tensor,
        q_pe: Tensor,
        keys: Tensor,
        mask: Tensor | None,
        path: AttnPath,
        *,
        causal: bool = False,
    ) -> Tensor:
        """Attention of queries (B, T, N, P) / (B, T, N, R) over latent keys (B, K, L+R) under a bool mask
        (B, T, K) (None: every key visible), then o_proj -> (B, T, H). For engines that assemble keys and
        masks themselves. Keys are in the compute dtype; the absorbed path also takes them as float32
        holding values of the compute dtype (the engine's resident buffer, ``mlaq.engine.resident``).
        ``causal``: the caller knows ``mask`` is exactly the square causal mask (T = K, query i sees
        keys 0..i), so the naive path need not compare it with one. Under ``Precision.ABSORBED`` the
        naive path is the absorbed one (prefill with the scheme's BMMs)."""
        c = self.config
        b, t = q_nope.shape[:2]
        if keys.dim() != 3 or keys.shape[0] != b or keys.shape[2] != c.latent_dim:
            raise ValueError(f"keys must be (B={b}, K, L+R={c.latent_dim}), got {tuple(keys.shape)}")
        held = path is AttnPath.ABSORBED and keys.dtype == torch.float32  # float32 holding its values
        if keys.dtype != self.dtype and not held:
            raise ValueError(f"latent cache is {keys.dtype} but the layer computes in {self.dtype}")
        if mask is not None and (tuple(mask.shape) != (b, t, keys.shape[1]) or mask.dtype != torch.bool):
            raise ValueError(
                f"mask must be bool (B, T, K) = {(b, t, keys.shape[1])}, got {mask.dtype} {tuple(mask.shape)}"
            )
        scale = self.softmax_scale
        ab = self._absorbed
        if path is AttnPath.NAIVE and ab is not None and ab.precision is Precision.ABSORBED:
            path = AttnPath.ABSORBED  # prefill runs the scheme's two BMMs, as decode does
        if path is AttnPath.NAIVE:
            kv_b, kernel = self.naive_kv_b(), self.prefill_kernel
            o = naive_attention(
                q_nope,
                q_pe,
                keys,
                mask,
                kv_b,
                scale,
                causal=causal,
                kernel=kernel,
                decompress=self.kv_b_online,
            )
        elif path is AttnPath.ABSORBED:
            o = absorbed_attention(q_nope, q_pe, keys, mask, self._checked_absorbed(), scale)
        else:
            raise ValueError(f"path must be an AttnPath, got {path!r}")
        return self.o_proj(o.reshape(b, t, c.num_heads * c.v_head_dim))  # (B, T, N*V) -> (B, T, H)

    def forward(
        self,
        hidden: Tensor,
        positions: Tensor,
        cache: Tensor | None = None,
        cache_lens: Tensor | None = None,
        *,
        path: AttnPath = AttnPath.NAIVE,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """hidden (B, T, H) at positions (B, T), over cache (B, S, L+R) with cache_lens (B,) (default S)
        and an optional extra bool key_mask (B, T, K) in position coordinates (DSA top-k; True = keep).
        Returns (output (B, T, H), new cache entries (B, T, L+R))."""
        proj = self.project(hidden, positions)
        b = hidden.shape[0]
        check_cache(cache, cache_lens, b, self.config.latent_dim, self.dtype)
        keys, valid = assemble_keys(cache, cache_lens, proj.latent, positions)
        mask = attention_mask(positions, valid, key_mask)
        return self.attend(proj.q_nope, proj.q_pe, keys, mask, path), proj.latent

    def extra_repr(self) -> str:
        ab = self._absorbed
        scheme = (
            "unprepared" if ab is None else f"{ab.scheme_uk.name}/{ab.scheme_uv.name}, {ab.precision.value}"
        )
        return f"absorbed BMMs: {scheme}"
