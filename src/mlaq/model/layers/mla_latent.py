"""The softmax and the value matmul over MLA's latent cache, whole or in blocks of queries.

The reference attention arithmetic (``mlaq.model.layers.mla_core``): scores in float32, softmax in float32 over
the visible keys, probabilities rounded to the compute dtype, then o_latent = probs @ c_kv, rounded
to the compute dtype. Shapes: b batch, n head, t query token, k key, l kv_lora_rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaq.model.layers.linear import native_low_precision_gemm


def masked_softmax(scores: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """float32 softmax of scores (B, N, T, K) over visible keys (mask (B, T, K), None = all visible);
    rows that see no key give zeros, not NaN. Values are rounded to ``dtype`` (the compute dtype) and
    returned as float32."""
    if mask is None:
        return torch.softmax(scores.float(), dim=-1).to(dtype).float()
    m = mask[:, None, :, :]  # (B, 1, T, K)
    probs = torch.softmax(scores.float().masked_fill(~m, float("-inf")), dim=-1)
    probs = torch.where(m.any(-1, keepdim=True), probs, torch.zeros((), device=probs.device))
    return probs.to(dtype).float()


def masked_softmax_(scores: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """:func:`masked_softmax` computed in place in ``scores`` (float32 (B, N, T, K), owned by the caller)
    and returned: the same values bit for bit, without its four full-size temporaries. Under autograd
    (``scores`` requires grad) and inside torch.compile (a model compiled whole: an out= alias of the
    input and a data-dependent branch break inductor's graph) it is masked_softmax itself."""
    if scores.requires_grad or torch.compiler.is_compiling():
        return masked_softmax(scores, mask, dtype)
    if mask is not None:
        m = mask[:, None, :, :]  # (B, 1, T, K)
        scores.masked_fill_(~m, float("-inf"))
    torch.ops.aten._softmax.out(scores, -1, False, out=scores)  # row by row: each read before written
    if mask is not None:
        rows = m.any(-1, keepdim=True)  # (B, 1, T, 1)
        if not bool(rows.all()):  # rows that see no key: zeros, not NaN
            scores.masked_fill_(~rows, 0.0)
    if dtype != torch.float32:
        scores.copy_(scores.to(dtype))
    return scores


QUERY_BLOCK = 256  # query rows per block of latent_attention_blocked
KEY_ALIGN = 512  # a block's key range is rounded up to a multiple of this (see latent_attention_blocked)


def wants_blocks(mask: Tensor | None, t: int) -> bool:
    """Whether a run of ``t`` masked queries goes through :func:`latent_attention_blocked` (long
    teacher-forced windows and task tails) rather than one (T, K) score matrix."""
    return mask is not None and t >= 2 * QUERY_BLOCK


def bf16_value_gemm(dtype: torch.dtype) -> bool:
    """Whether :func:`latent_values` multiplies in bf16 (``linear.native_low_precision_gemm``: oneDNN's
    bf16 GEMM, where it beats float32 on this CPU)."""
    return dtype == torch.bfloat16 and native_low_precision_gemm()


def latent_values(probs: Tensor, c_kv: Tensor, dtype: torch.dtype) -> Tensor:
    """The value matmul o_latent = probs @ c_kv: probs (B, M, K) float32 holding values of the compute
    ``dtype``, c_kv (B, K, L) in ``dtype`` or float32 holding its values -> (B, M, L) float32; its
    values are rounded to ``dtype`` unless ``dtype`` is float32 (then the float32 product, unrounded).

    Both operands are exact in ``dtype``, so a bf16 GEMM (exact products, float32 accumulation, one
    rounding to bf16: FlashMLA's P @ V) and a float32 GEMM rounded once to bf16 compute the same sums
    in different orders (about 1 output in 3,000 differs by one bf16 ulp). Where the CPU has a fast
    bf16 GEMM (oneDNN with AMX, or AVX512_BF16 on AMD) and c_kv is held in bf16, the bf16 one runs:
    2.1-2.4x faster on an AMD EPYC Zen 4; elsewhere (Intel without AMX included), and for keys already
    held in float32 (decode over the engine's resident buffer: no conversion pass), the float32 one
    (torch's generic bf16 kernel is several times slower).
    """
    if bf16_value_gemm(dtype) and c_kv.dtype == dtype:
        return torch.bmm(probs.to(dtype), c_kv).float()
    out = torch.bmm(probs, c_kv.float())
    return out if dtype == torch.float32 else out.to(dtype).float()


def latent_attention_blocked(
    q: Tensor, keys: Tensor, mask: Tensor, lora: int, scale: float, dtype: torch.dtype
) -> Tensor:
    """softmax(q . keys * scale, mask) @ keys[..., :lora] for q (B, N, T, L+R) float32, keys (B, K, L+R)
    in the compute dtype (or float32 holding its values), mask (B, T, K) -> (B, N, T, L) float32
    rounded as :func:`latent_values` rounds, in blocks of QUERY_BLOCK queries, each over the keys up
    to the last one any of its rows sees, rounded up to KEY_ALIGN: under a causal mask over 2048
    keys 37 % fewer multiply-adds than the whole (T, K) score matrix, and a block's scores stay in
    cache.

    The arithmetic per row is masked_softmax's and the value matmul's: a key a block leaves out has
    weight exactly 0, so every sum is the same sum, up to the order the GEMM sums it in for the shorter
    product (MKL's float32 GEMM keeps its order at multiples of 512 keys: a shorter product summed
    181,109 of 1,048,576 outputs in another order; oneDNN's bf16 GEMM does not always). Scores are
    unaffected (keys are their output axis). tests/test_mla_blocked.py compares with the whole matrix.
    """
    b, n, t, c = q.shape
    kf = keys.float()
    values = keys if bf16_value_gemm(dtype) else kf  # in the dtype latent_values multiplies in, once
    num_keys = kf.shape[1]
    out = q.new_empty(b, n, t, lora)
    reach = mask.any(0)  # (T, K): keys some row at this query index sees
    for start in range(0, t, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, t)
        seen = reach[start:end].any(0).nonzero()  # (k, 1)
        last = int(seen[-1]) + 1 if seen.numel() else 1
        width = min(num_keys, -(-last // KEY_ALIGN) * KEY_ALIGN)
        qb = q[:, :, start:end].reshape(b, n * (end - start), c)  # (B, N*t', L+R)
        scores = torch.bmm(qb, kf[:, :width].transpose(1, 2)).view(b, n, end - start, width)  # (B, N, t', k)
        probs = masked_softmax_(scores.mul_(scale), mask[:, start:end, :width], dtype)
        o = latent_values(
            probs.view(b, n * (end - start), width), values[:, :width, :lora], dtype
        )  # (B, N*t', L)
        out[:, :, start:end] = o.view(b, n, end - start, lora)
    return out
