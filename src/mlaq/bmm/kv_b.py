"""kv_b_proj -> the two absorbed-BMM weights in the (N, K, M) layout every scheme takes.

kv_b_proj's weight is [N * (P + V), L] (out, in): per head n, rows [n(P+V), n(P+V)+P) are W_UK[n]
(P x L) and the next V rows are W_UV[n] (V x L). The BMMs use
  q absorption     (N, B, P) @ W_UK          (N, K=P, M=L)
  V up-projection  (N, B, L) @ W_UV^T        (N, K=L, M=V)
"""

from __future__ import annotations

from torch import Tensor

from mlaq.formats import Fp8Tensor, MxTensor
from mlaq.formats.blocks import resolve_block


def split_kv_b_proj(
    weight: Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[Tensor, Tensor]:
    """[N*(P+V), L] -> (W_UK (N, P, L), W_UV^T (N, L, V)), views of ``weight`` where possible."""
    rows, lora = weight.shape if weight.dim() == 2 else (-1, -1)
    want = num_heads * (qk_nope_head_dim + v_head_dim)
    if weight.dim() != 2 or rows != want:
        raise ValueError(
            f"kv_b_proj weight of shape {tuple(weight.shape)} does not fit num_heads={num_heads}, "
            f"qk_nope_head_dim={qk_nope_head_dim}, v_head_dim={v_head_dim}: expected [{want}, kv_lora_rank]"
        )
    per_head = weight.view(num_heads, qk_nope_head_dim + v_head_dim, lora)  # (N, P+V, L)
    w_uk, w_uv = per_head.split([qk_nope_head_dim, v_head_dim], dim=1)  # (N, P, L), (N, V, L)
    return w_uk, w_uv.transpose(1, 2)


def split_kv_b_proj_fp8(
    weight: Fp8Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """A block-FP8 kv_b_proj (DeepSeek-V3 ``weight`` + ``weight_scale_inv``) -> ((codes, scale) of W_UK,
    (codes, scale) of W_UV^T), scales expanded per element: the input of
    ``Fp8PerBlock.prepare_quantized``. Exact for any geometry, including blocks that straddle heads."""
    scale = weight.expanded_scale().contiguous()  # [N*(P+V), L] fp32
    uk_c, uv_c = split_kv_b_proj(weight.codes, num_heads, qk_nope_head_dim, v_head_dim)
    uk_s, uv_s = split_kv_b_proj(scale, num_heads, qk_nope_head_dim, v_head_dim)
    return (uk_c.contiguous(), uk_s.contiguous()), (uv_c.contiguous(), uv_s.contiguous())


def split_kv_b_proj_fp8_scaled(
    weight: Fp8Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """A per-tensor or per-channel FP8 kv_b_proj (compressed-tensors / Quark ``weight`` + ``weight_scale``,
    as an Fp8Tensor with block (None, None) or (1, None)) -> ((codes, scale) of W_UK, (codes, scale) of
    W_UV^T), each scale at its real granularity along the BMM's (N, K, M):

    - per-tensor: (1, 1, 1) for both halves (``fp8_per_tensor.prepare_quantized``);
    - per-channel (one scale per OUTPUT ROW of kv_b_proj): W_UV^T's rows are its M columns, so (N, 1, V)
      (``fp8_per_channel.prepare_quantized``); W_UK's rows are its K = P axis, so (N, P, 1) — a scale
      varying along the reduction axis, which only ``fp8_per_block.prepare_quantized`` runs exactly.
    """
    rows, lora = weight.shape
    lengths = resolve_block(weight.shape, weight.block)
    if lengths not in ((rows, lora), (1, lora)):
        raise ValueError(
            f"expected a per-tensor or per-output-row FP8 kv_b_proj [{rows}, {lora}], got block {weight.block}; "
            "block-FP8 weights go through split_kv_b_proj_fp8"
        )
    uk_c, uv_c = split_kv_b_proj(weight.codes, num_heads, qk_nope_head_dim, v_head_dim)
    if lengths == (rows, lora):
        one = weight.scale.reshape(1, 1, 1)
        return (uk_c.contiguous(), one), (uv_c.contiguous(), one)
    # scale [N*(P+V), 1] -> W_UK (N, P, 1): per K row; W_UV^T (N, 1, V): per M column
    uk_s, uv_s = split_kv_b_proj(weight.scale, num_heads, qk_nope_head_dim, v_head_dim)
    return (uk_c.contiguous(), uk_s.contiguous()), (uv_c.contiguous(), uv_s.contiguous())


def split_kv_b_proj_mx_uv(
    weight: MxTensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> MxTensor:
    """W_UV^T (N, L, V) of an MX kv_b_proj (Quark: blocks of 32 along L, the in-dim), blocks still along
    L = the V up-projection's K: the input of ``prepare_quantized`` of the MX schemes.

    W_UK has no such counterpart: its blocks run along L, which is the q absorption's output axis M,
    so a K-blocked kernel cannot use them; it must be re-quantized (``prepare`` of its dequantized value).
    """
    if len(weight.shape) != 2 or weight.axis % 2 != 1:
        raise ValueError(
            f"expected a 2-D MX kv_b_proj [N*(P+V), L] with blocks along L (axis 1), got shape "
            f"{weight.shape}, axis {weight.axis}"
        )
    _, uv_codes = split_kv_b_proj(weight.codes, num_heads, qk_nope_head_dim, v_head_dim)  # (N, L, V)
    _, uv_scales = split_kv_b_proj(weight.scales, num_heads, qk_nope_head_dim, v_head_dim)  # (N, L/32, V)
    return MxTensor(
        uv_codes.contiguous(),
        uv_scales.contiguous(),
        weight.elem,
        weight.rule,
        1,
        weight.block_size,
        tuple(uv_codes.shape),
    )
