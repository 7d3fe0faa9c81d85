"""The absorbed MLA path with its attention over the cache in torch's fused CPU attention kernel.

``absorbed_attention`` (mla_core) computes the reference arithmetic: every score in float32, the softmax
normalized, the probabilities rounded to the compute dtype, then the value matmul. Reading the latent
cache twice in float32 is most of a batched decode step on a CPU; torch's
flash kernel (``scaled_dot_product_attention`` on CPU) reads it once, in the compute dtype, block by
block: scores in float32, an online softmax, each block's probabilities rounded to the compute dtype
*before* normalization (relative to the running maximum) and the sum divided out at the end, as
FlashAttention and FlashMLA do. Outputs differ from the reference in the last bits of the compute dtype
(bf16: about a third of o_latent's elements one step apart); ``compile=True`` (mlaq.engine.compiled)
attends this way, eager decode and ``mlaq validate`` keep the reference.

MLA's absorbed attention is multi-query: N query heads share one latent key per token. The heads are
folded into the query axis (one kv head, N*T queries), keys double as values ([c_kv | k_pe], the
output's last R columns dropped), so the kernel reads the cache in place without a copy. BMM #1 and #2
run through the layer's scheme as in ``absorbed_attention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlaq.model.layers.mla_core import AbsorbedWeights, absorbed_output, absorbed_queries


def absorbed_attention_flash(
    q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor | None, w: AbsorbedWeights, scale: float
) -> Tensor:
    """``absorbed_attention``'s signature and result (B, T, N, V) in the compute dtype, attending with
    torch's fused kernel: q_nope (B, T, N, P), q_pe (B, T, N, R), keys (B, K, L+R) in the compute dtype
    (or float32 holding its values), mask (B, T, K) bool (True = attend) or None (every key visible).
    The three steps below, in order; ``compile=True`` runs BMM #1 and #2 inside its compiled pieces."""
    n, dtype = q_nope.shape[2], q_nope.dtype
    o = flash_attend(flash_queries(q_nope, q_pe, w), keys, mask, n, scale)
    return flash_output(o, w, n, dtype)


def flash_queries(q_nope: Tensor, q_pe: Tensor, w: AbsorbedWeights) -> Tensor:
    """BMM #1 with ``w.scheme_uk`` and the heads folded into the query axis: q_nope (B, T, N, P),
    q_pe (B, T, N, R) -> (B, 1, N*T, L+R) in the compute dtype, query row h*T + i = head h, token i."""
    b, t, n, _ = q_nope.shape
    return absorbed_queries(q_nope, q_pe, w).to(q_nope.dtype).reshape(b, 1, n * t, -1)


def flash_attend(q: Tensor, keys: Tensor, mask: Tensor | None, n: int, scale: float) -> Tensor:
    """The attention over the cache in torch's fused kernel: folded queries q (B, 1, N*T, L+R), keys
    (B, K, L+R) (cast to q's dtype; read in place when already in it), mask (B, T, K) or None, N heads
    -> (B, 1, N*T, L+R) in q's dtype (its last R columns are the keys' rope part: ignored)."""
    b, _, rows, _ = q.shape
    k = keys.to(q.dtype)[:, None]  # (B, 1, K, L+R): one kv head, keys doubling as values
    m = None
    if mask is not None:  # (B, T, K) -> (B, 1, N*T, K)
        t = rows // n
        m = mask[:, None, None].expand(b, 1, n, t, mask.shape[-1]).reshape(b, 1, rows, -1)
    return F.scaled_dot_product_attention(q, k, k, attn_mask=m, scale=scale)


def flash_output(o: Tensor, w: AbsorbedWeights, n: int, dtype: torch.dtype) -> Tensor:
    """BMM #2 with ``w.scheme_uv`` on ``flash_attend``'s result o (B, 1, N*T, L+R) -> (B, T, N, V) in
    ``dtype``."""
    b, _, rows, _ = o.shape
    lora = w.w_uv.shape[1]
    o_latent = o.view(b, n, rows // n, -1)[..., :lora].transpose(0, 1)  # (N, B, T, L)
    return absorbed_output(o_latent, w, dtype)  # (B, T, N, V)
