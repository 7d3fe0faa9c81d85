"""MLA's math as pure functions: key assembly, masks, naive and absorbed attention (the softmax, the
value matmul and blocked attention over the latent cache: ``mlaq.model.layers.mla_latent``).

Letters in shapes and einsum strings: b batch, t query token (T), s key position (S), n head (N),
p qk_nope_head_dim (P), r qk_rope_head_dim (R), l kv_lora_rank (L), v v_head_dim (V), c = L + R.
A latent-cache entry is [c_kv | k_pe] (c = L + R values), k_pe already rotated.
Attention arithmetic: score matmuls in float32 on operands held in the compute dtype, softmax in float32,
probabilities rounded to the compute dtype before the value matmul (what bf16 flash-attention kernels do);
in float32 every rounding is the identity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.model.layers.linear import linear, native_low_precision_gemm
from mlaq.model.layers.mla_latent import (
    latent_attention_blocked,
    latent_values,
    masked_softmax,
    masked_softmax_,
    wants_blocks,
)

if TYPE_CHECKING:
    from mlaq.model.kernels.mla_kernel import MlaKernel


class Precision(Enum):
    """What prefill (the naive path) computes once the absorbed BMMs are prepared."""

    DECODE_ONLY = "decode_only"  # naive: kv_b_proj at checkpoint precision (vLLM); absorbed: the scheme
    CONSISTENT = "consistent"  # naive: the scheme's dequantized W_UK / W_UV too (one precision for both)
    # prefill runs the absorbed path itself, the scheme's two BMMs with their activation rounding, exactly
    # as decode does: every token's log-probabilities carry the whole scheme (like-for-like teacher forcing)
    ABSORBED = "absorbed"


@dataclass(frozen=True)
class AbsorbedWeights:
    """W_UK and W_UV^T prepared for the two absorbed BMMs, and how the naive path must treat them."""

    w_uk: PreparedWeight  # (N, P, L): q absorption, ql = q_nope @ W_UK
    w_uv: PreparedWeight  # (N, L, V): V up-projection, out = o_latent @ W_UV^T
    scheme_uk: BmmScheme
    scheme_uv: BmmScheme
    precision: Precision
    source: tuple[int, int] | None = None  # (data_ptr, _version) of kv_b_proj.weight it was split from

    def kv_b_weight(self) -> Tensor:
        """The dequantized weights re-joined in kv_b_proj's layout, float32 (N*(P+V), L)."""
        return join_kv_b(self.w_uk.dequantize(), self.w_uv.dequantize())


def join_kv_b(w_uk: Tensor, w_uv_t: Tensor) -> Tensor:
    """Inverse of mlaq.bmm.split_kv_b_proj: W_UK (N, P, L), W_UV^T (N, L, V) -> (N*(P+V), L)."""
    lora = w_uk.shape[2]
    per_head = torch.cat((w_uk, w_uv_t.transpose(1, 2)), dim=1)  # (N, P+V, L)
    return per_head.reshape(-1, lora)  # (N*(P+V), L)


def assemble_keys(
    cache: Tensor | None, cache_lens: Tensor | None, latent: Tensor, positions: Tensor
) -> tuple[Tensor, Tensor]:
    """Write the new entries into a copy of the cache at their positions ("write, then read").

    cache (B, S, C) holds positions 0..cache_lens[b]-1 of row b (rest ignored); latent (B, T, C) are the new
    tokens' entries at ``positions`` (B, T). Returns keys (B, K, C) indexed by position, K = max(S, max
    position + 1), and key_valid (B, K): which positions hold a real entry.
    """
    b, t, c = latent.shape
    if bool((positions < 0).any()):
        raise ValueError(f"positions must be >= 0, got min {int(positions.min())}")
    s = 0 if cache is None else cache.shape[1]
    num_keys = max(s, int(positions.max()) + 1)
    keys = latent.new_zeros(b, num_keys, c)
    valid = torch.zeros(b, num_keys, dtype=torch.bool, device=latent.device)
    if cache is not None:
        keys[:, :s] = cache
        lens = torch.full((b,), s, device=latent.device) if cache_lens is None else cache_lens
        valid[:, :s] = torch.arange(s, device=latent.device) < lens[:, None]  # (B, S)
    idx = positions.long()  # (B, T)
    keys.scatter_(1, idx[:, :, None].expand(b, t, c), latent)
    valid.scatter_(1, idx, True)
    return keys, valid


def attention_mask(positions: Tensor, key_valid: Tensor, key_mask: Tensor | None = None) -> Tensor:
    """(B, T, K) bool: query at position p may see key position j iff j <= p, j is valid, and key_mask.

    key_mask (B, T, K') (e.g. DSA's top-k selection, True = keep) is in the same position coordinates;
    K' must exceed every query position; columns past K are dropped, missing ones count as False
    (they lie beyond every query position, so causality masks them anyway).
    """
    b, k = key_valid.shape
    key_pos = torch.arange(k, device=key_valid.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None]) & key_valid[:, None, :]  # (B, T, K)
    if key_mask is None:
        return mask
    t = positions.shape[1]
    if key_mask.dtype != torch.bool or key_mask.dim() != 3 or tuple(key_mask.shape[:2]) != (b, t):
        raise ValueError(
            f"key_mask must be a bool tensor (B={b}, T={t}, K), got {key_mask.dtype} {tuple(key_mask.shape)}"
        )
    if key_mask.shape[2] <= int(positions.max()):
        raise ValueError(
            f"key_mask covers {key_mask.shape[2]} key positions, but a query sits at position "
            f"{int(positions.max())}; it must cover positions 0..max(positions)"
        )
    if key_mask.shape[2] >= k:
        return mask & key_mask[:, :, :k]
    pad = key_mask.new_zeros(b, t, k - key_mask.shape[2])
    return mask & torch.cat((key_mask, pad), dim=2)


def is_causal(mask: Tensor | None) -> bool:
    """Whether mask (B, T, K) is exactly the top-left causal mask (T = K, query i sees keys 0..i):
    a whole prompt without padding, which SDPA's ``is_causal`` runs without reading a mask."""
    if mask is None or mask.shape[1] != mask.shape[2]:
        return False
    t = mask.shape[1]
    return bool(
        torch.equal(mask, torch.ones(t, t, dtype=torch.bool, device=mask.device).tril().expand_as(mask))
    )


def check_cache(
    cache: Tensor | None, cache_lens: Tensor | None, b: int, latent_dim: int, dtype: torch.dtype
) -> None:
    """A latent cache (B, S, L+R) in the layer's dtype with lengths (B,) in 0..S, or a clear error."""
    if cache is None:
        if cache_lens is not None:
            raise ValueError("cache_lens given without a cache")
        return
    if cache.dim() != 3 or cache.shape[0] != b or cache.shape[2] != latent_dim:
        raise ValueError(f"cache must be (B={b}, S, L+R={latent_dim}), got {tuple(cache.shape)}")
    if cache.dtype != dtype:
        raise ValueError(f"latent cache is {cache.dtype} but the layer computes in {dtype}")
    if cache_lens is not None and (
        tuple(cache_lens.shape) != (b,) or bool((cache_lens < 0).any() | (cache_lens > cache.shape[1]).any())
    ):
        raise ValueError(
            f"cache_lens must be (B={b},) with values in 0..S={cache.shape[1]}, got {cache_lens.tolist()}"
        )


def float32_flash(q: Tensor) -> bool:
    """Whether :func:`naive_attention` runs torch's flash kernel in float32 on ``q``'s bf16 values: on a CPU
    whose bf16 GEMMs run through float32 (``linear.native_low_precision_gemm``), where the bf16 flash
    kernel multiplies through the slow bf16 GEMM (Intel Xeon Emerald Rapids with AMX hidden, torch 2.13,
    2 threads: a 4,096-token causal layer of the bundled model in 0.25 s, 0.15 s in float32)."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and not native_low_precision_gemm()


def naive_attention(
    q_nope: Tensor,
    q_pe: Tensor,
    keys: Tensor,
    mask: Tensor | None,
    kv_b: Tensor,
    scale: float,
    *,
    causal: bool = False,
    kernel: MlaKernel | None = None,
    decompress: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Decompress every key: K_nope = W_UK c_kv, V = W_UV c_kv; ordinary attention. -> (B, T, N, V).

    q_nope (B, T, N, P), q_pe (B, T, N, R), keys (B, K, L+R), kv_b (N*(P+V), L) in the compute dtype.
    Runs torch's fused CPU attention (``scaled_dot_product_attention``: scores accumulated in float32,
    online float32 softmax, probabilities in the compute dtype for the value matmul), no less accurate
    than the unfused ops against a float32 reference. V is zero-padded to QK's head dim (128 -> 192 in
    DeepSeek-V3) so that torch takes its flash kernel, not the math path (which materialises the
    (T, K) scores and a masked softmax); a plain causal mask goes as ``is_causal`` (the kernel skips
    the blocks above the diagonal). Rows that see no key (possible only under a DSA key mask) take
    the unfused path, which gives them zeros. ``causal=True``: the caller knows ``mask`` is exactly
    the square causal mask (``is_causal``), and the check over its T x K entries is skipped.
    ``kernel``: causal attention runs in mlaq's C kernel instead (``mla_kernel``, ``compile=True``'s
    choice; V unpadded, probabilities in float32). On CPUs that multiply bf16 through float32
    (:func:`float32_flash`) the same flash kernel runs on the operands' values held in float32: the
    probabilities then stay in float32, as in the C kernel, and the output is rounded once.
    ``decompress``: c_kv (B, K, L) -> (B, K, N*(P+V)) in place of ``c_kv @ kv_b^T`` (an online-quantized
    kv_b_proj linear, vLLM's meaning of targets).
    """
    b, _, n, p = q_nope.shape
    lora = kv_b.shape[1]
    c_kv, k_pe = keys.split([lora, keys.shape[-1] - lora], dim=-1)  # (B, K, L), (B, K, R)
    kv = linear(c_kv, kv_b) if decompress is None else decompress(c_kv)  # (B, K, N*(P+V)), compute dtype
    kv = kv.view(b, keys.shape[1], n, -1)  # (B, K, N, P+V)
    k_nope, v = kv.split([p, kv.shape[-1] - p], dim=-1)  # (B, K, N, P), (B, K, N, V)
    if causal or mask is None or bool(mask.any(dim=-1).all()):
        q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1).transpose(1, 2)  # (B, N, T, P+R)
        k_pe_heads = k_pe[:, :, None, :].expand(-1, -1, n, -1)  # the shared rope key, every head
        k = torch.cat((k_nope, k_pe_heads), dim=-1).transpose(1, 2)  # (B, N, K, P+R)
        vh = v.transpose(1, 2)  # (B, N, K, V)
        causal = causal or is_causal(mask)
        if causal and kernel is not None and kernel.prefills(q, k, vh):
            return kernel.prefill(q, k, vh, scale).transpose(1, 2)  # (B, T, N, V)
        if vh.shape[-1] != q.shape[-1]:  # torch's CPU flash kernel needs V's head dim = QK's
            vh = torch.nn.functional.pad(vh, (0, q.shape[-1] - vh.shape[-1]))  # zero columns
        if float32_flash(q):
            q, k, vh = q.float(), k.float(), vh.float()  # exact: the values stay the compute dtype's
        attn_mask = None if mask is None or causal else mask[:, None, :, :]  # (B, 1, T, K)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, vh, attn_mask=attn_mask, is_causal=causal, scale=scale
        )  # (B, N, T, QK)
        return o[..., : v.shape[-1]].transpose(1, 2).to(q_nope.dtype)
    scores = torch.einsum("btnp,bsnp->bnts", q_nope.float(), k_nope.float())
    scores = scores + torch.einsum("btnr,bsr->bnts", q_pe.float(), k_pe.float())  # shared rope key
    probs = masked_softmax(scores * scale, mask, q_nope.dtype)  # (B, N, T, K)
    return torch.einsum("bnts,bsnv->btnv", probs, v.float()).to(q_nope.dtype)


def absorbed_queries(q_nope: Tensor, q_pe: Tensor, w: AbsorbedWeights) -> Tensor:
    """BMM #1 with ``w.scheme_uk`` (ql = q_nope W_UK), joined with q_pe -> [ql | q_pe] (B, N, T, L+R)
    float32, its values in the compute dtype."""
    b, t, n, p = q_nope.shape
    dtype = q_nope.dtype
    lora = w.w_uk.shape[2]
    x = q_nope.permute(2, 0, 1, 3).reshape(n, b * t, p)  # (B, T, N, P) -> (N, B*T, P)
    ql = w.scheme_uk.apply(x, w.w_uk)  # (N, B*T, L), float32 rounded as the scheme's kernel rounds
    ql = ql.view(n, b, t, lora).permute(1, 0, 2, 3).to(dtype)  # (B, N, T, L)
    return torch.cat((ql, q_pe.permute(0, 2, 1, 3).to(dtype)), dim=-1).float()  # (B, N, T, L+R)


def absorbed_scores(q_nope: Tensor, q_pe: Tensor, keys: Tensor, w: AbsorbedWeights, scale: float) -> Tensor:
    """The absorbed path's scaled attention scores before the mask and softmax: BMM #1 with
    ``w.scheme_uk``, then [ql | q_pe] . [c_kv | k_pe] over the latent keys -> (B, N, T, K) float32."""
    b, t, n, _ = q_nope.shape
    q = absorbed_queries(q_nope, q_pe, w)  # (B, N, T, L+R)
    scores = torch.bmm(q.reshape(b, n * t, -1), keys.float().transpose(1, 2))  # (B, N*T, K)
    return scores.view(b, n, t, -1).mul_(scale)


def absorbed_attention(
    q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor | None, w: AbsorbedWeights, scale: float
) -> Tensor:
    """Attend in latent space with the two BMMs; the cache is never decompressed. -> (B, T, N, V).

    BMM #1 ql = q_nope W_UK; scores = [ql | q_pe] . [c_kv | k_pe] (= ql . c_kv + q_pe . k_pe, one
    matmul over the cache as FlashMLA does); o_latent = softmax @ c_kv; BMM #2 out = o_latent W_UV^T.
    Long masked query runs (teacher forcing, task tails) go through :func:`latent_attention_blocked`.
    """
    b, t, n, _ = q_nope.shape
    dtype = q_nope.dtype
    lora = w.w_uk.shape[2]
    if wants_blocks(mask, t):
        q = absorbed_queries(q_nope, q_pe, w)  # (B, N, T, L+R)
        o_latent = latent_attention_blocked(q, keys, mask, lora, scale, dtype)  # (B, N, T, L)
    else:
        probs = masked_softmax_(absorbed_scores(q_nope, q_pe, keys, w, scale), mask, dtype)  # (B, N, T, K)
        o_latent = latent_values(probs.view(b, n * t, -1), keys[:, :, :lora], dtype).view(b, n, t, lora)
    return absorbed_output(o_latent.transpose(0, 1).to(dtype), w, dtype)


def absorbed_output(o_latent: Tensor, w: AbsorbedWeights, dtype: torch.dtype) -> Tensor:
    """BMM #2 with ``w.scheme_uv``: o_latent (N, B, T, L) -> out = o_latent W_UV^T (B, T, N, V) in ``dtype``."""
    n, b, t, lora = o_latent.shape
    out = w.scheme_uv.apply(o_latent.reshape(n, b * t, lora), w.w_uv)  # (N, B*T, V)
    return out.view(n, b, t, -1).permute(1, 2, 0, 3).to(dtype)  # (B, T, N, V)
