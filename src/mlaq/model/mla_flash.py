"""The absorbed MLA path with its attention over the cache in torch's fused CPU attention kernel.

``absorbed_attention`` (mla_core) computes the reference arithmetic: every score in float32, the softmax
normalized, the probabilities rounded to the compute dtype, then the value matmul. Reading the latent
cache twice in float32 is most of a batched decode step on a CPU (bench/RESULTS.md "Change 7"); torch's
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

import torch.nn.functional as F
from torch import Tensor

from mlaq.model.mla_core import AbsorbedWeights, absorbed_output, absorbed_queries


def absorbed_attention_flash(
    q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor | None, w: AbsorbedWeights, scale: float
) -> Tensor:
    """``absorbed_attention``'s signature and result (B, T, N, V) in the compute dtype, attending with
    torch's fused kernel: q_nope (B, T, N, P), q_pe (B, T, N, R), keys (B, K, L+R) in the compute dtype
    (or float32 holding its values), mask (B, T, K) bool (True = attend) or None (every key visible)."""
    b, t, n, _ = q_nope.shape
    dtype = q_nope.dtype
    lora = w.w_uk.shape[2]
    q = absorbed_queries(q_nope, q_pe, w).to(dtype).reshape(b, 1, n * t, -1)  # (B, 1, N*T, L+R)
    k = keys.to(dtype)[:, None]  # (B, 1, K, L+R): one kv head, read in place
    m = None
    if mask is not None:  # (B, T, K) -> (B, 1, N*T, K), query row h*T + i is head h at token i
        m = mask[:, None, None].expand(b, 1, n, t, mask.shape[-1]).reshape(b, 1, n * t, -1)
    o = F.scaled_dot_product_attention(q, k, k, attn_mask=m, scale=scale)  # (B, 1, N*T, L+R)
    o_latent = o.view(b, n, t, -1)[..., :lora].transpose(0, 1)  # (N, B, T, L)
    return absorbed_output(o_latent, w, dtype)  # (B, T, N, V)
