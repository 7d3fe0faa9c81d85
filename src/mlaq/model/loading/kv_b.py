"""Apply one policy decision to one MLA layer: build its absorbed BMM weights W_UK / W_UV^T.

- A stored e4m3fn FP8 format run as its ``_fnuz`` scheme (targets, for AMD gfx942) is converted exactly
  (vLLM's normalize_e4m3fn_to_e4m3fnuz: same bytes, 0x80 -> 0, scales doubled), never re-quantized.
- Rule ``checkpoint`` with block FP8 storage: the checkpoint's own e4m3 codes and 128x128 scales run
  as ``fp8_per_block`` unchanged (split per head exactly, blocks that straddle heads included).
- Per-tensor / per-channel FP8 storage (compressed-tensors, Quark) used as stored: the codes and scales
  run unchanged, W_UV^T as ``fp8_per_tensor`` / ``fp8_per_channel`` and W_UK as ``decision.scheme_uk``
  (``fp8_per_block`` for per-channel: the per-row scales lie along W_UK's reduction axis).
- MXFP4 storage used as stored: W_UV^T (K = L, the axis Quark blocks along) keeps its codes and E8M0
  scales; W_UK (K = P) cannot, so the scheme regroups it from the exactly dequantized weight.
- SGLang's schemes (``*_sglang``) quantize the whole (exactly dequantized) kv_b_proj with ONE scale and
  split it, as SGLang does: W_UK and W_UV^T share that scale.
- Otherwise the scheme does not run the stored format (targets / flags chose another): the stored weight
  is dequantized exactly (fp32) and the scheme's ``prepare`` quantizes it.
- ``tp_size`` > 1 (``--tensor-parallel-size``): a re-quantized weight is quantized per rank, over the heads
  each rank holds (:mod:`mlaq.bmm.tp`), SGLang's whole-kv_b scale over each rank's rows. The checkpoint's
  own codes and scales (rule ``checkpoint``) are sliced by the ranks unchanged, so they need no sharding.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from mlaq.bmm import PreparedWeight, get_scheme
from mlaq.bmm.kv_b import split_kv_b_proj, split_kv_b_proj_fp8, split_kv_b_proj_fp8_scaled
from mlaq.bmm.sglang_fp8 import sglang_kv_b_proj, whole_kv_b
from mlaq.bmm.tp import TensorParallel, head_shards, shard_heads
from mlaq.formats import MxElem, MxTensor, e4m3fn_to_e4m3fnuz
from mlaq.model.layers.mla import MLAttention
from mlaq.model.layers.mla_core import Precision
from mlaq.model.loading.weights import CheckpointWeight, WeightFormat

# policy StoredFormat.name -> the on-disk format the loader must have found
_STORED = MappingProxyType(
    {
        "fp8_per_block": WeightFormat.FP8_BLOCK,
        "fp8_per_channel": WeightFormat.FP8_PER_CHANNEL,
        "fp8_per_tensor": WeightFormat.FP8_PER_TENSOR,
        "mxfp4": WeightFormat.MXFP4,
    }
)


def apply_decision(
    attn: MLAttention, decision: Any, stored: CheckpointWeight, precision: Precision, tp_size: int = 1
) -> None:
    """Prepare ``attn``'s absorbed BMMs as ``decision`` (a policy LayerDecision) says."""
    c = attn.config
    w_uk, w_uv = prepare_absorbed(decision, stored, c.num_heads, c.qk_nope_head_dim, c.v_head_dim, tp_size)
    scheme, scheme_uk = absorbed_schemes(decision, tp_size)
    attn.set_absorbed(w_uk, w_uv, scheme_uk, precision=precision, scheme_uv=scheme)


def absorbed_schemes(decision: Any, tp_size: int = 1) -> tuple[Any, Any]:
    """(W_UV^T's scheme, W_UK's scheme), run per tensor-parallel shard where the loader re-quantizes."""
    scheme, scheme_uk = get_scheme(decision.scheme), get_scheme(decision.scheme_uk)
    if decision.uses_checkpoint_data:
        return scheme, scheme_uk
    return shard_heads(scheme, tp_size), shard_heads(scheme_uk, tp_size)


def prepare_absorbed(
    decision: Any, stored: CheckpointWeight, n: int, p: int, v: int, tp_size: int = 1
) -> tuple[PreparedWeight, PreparedWeight]:
    """(W_UK as ``decision.scheme_uk``, W_UV^T as ``decision.scheme``) exactly as the loader prepares them
    from ``stored`` (N heads, P = qk_nope_head_dim, V = v_head_dim) on ``tp_size`` ranks; ``mlaq audit``
    measures these."""
    check_stored(decision, stored)
    scheme, scheme_uk = absorbed_schemes(decision, tp_size)
    if isinstance(scheme, TensorParallel) and whole_kv_b(scheme.inner):
        assert isinstance(scheme_uk, TensorParallel)
        rows = stored.dequantize().view(n, p + v, -1)  # (N, P+V, L): rank r's rows are its heads'
        parts = [
            sglang_kv_b_proj(
                scheme_uk.inner, scheme.inner, rows[a:b].reshape(-1, rows.shape[-1]), b - a, p, v
            )  # type: ignore[arg-type]
            for a, b in head_shards(n, tp_size)
        ]
        return (
            scheme_uk.prepare_shards(tuple(uk for uk, _ in parts)),
            scheme.prepare_shards(tuple(uv for _, uv in parts)),
        )
    if not decision.uses_checkpoint_data and whole_kv_b(scheme) and whole_kv_b(scheme_uk):
        return sglang_kv_b_proj(scheme_uk, scheme, stored.dequantize(), n, p, v)  # type: ignore[arg-type]
    if not decision.uses_checkpoint_data:
        w_uk_t, w_uv_t = split_kv_b_proj(stored.dequantize(), n, p, v)  # (N, P, L), (N, L, V) fp32
        return scheme_uk.prepare(w_uk_t), scheme.prepare(w_uv_t)
    if stored.format in _FP8_SPLIT:
        fp8 = stored.fp8()
        if decision.converts_to_fnuz:  # same bytes worth half in e4m3fnuz: doubled scales keep every value
            fp8 = e4m3fn_to_e4m3fnuz(fp8)
        (uk_codes, uk_scale), (uv_codes, uv_scale) = _FP8_SPLIT[stored.format](fp8, n, p, v)
        w_uk = scheme_uk.prepare_quantized(uk_codes, uk_scale)  # type: ignore[attr-defined]
        return w_uk, scheme.prepare_quantized(uv_codes, uv_scale)  # type: ignore[attr-defined]
    if stored.format is WeightFormat.MXFP4:
        w_uk_t, _ = split_kv_b_proj(stored.dequantize(), n, p, v)
        return scheme_uk.prepare(w_uk_t), scheme.prepare_quantized(_mx_w_uv_t(stored, n, p, v))  # type: ignore[attr-defined]
    # the policy promised the stored format unchanged: never fall back to re-quantizing it
    raise ValueError(
        f"{stored.name}.weight: the policy runs kv_b_proj as {decision.scheme} on the checkpoint's own "
        f"{stored.format.value} data, which the loader cannot pass to it unchanged"
    )


def check_stored(decision: Any, stored: CheckpointWeight) -> None:
    """The format ``decision`` (from config.json) expects is the one the safetensors file holds."""
    # a quantized format the loader has no reader for (mxfp8, nvfp4, ...) can never match the file
    if decision.stored.quantized and stored.format is not _STORED.get(decision.stored.name):
        raise ValueError(
            f"{stored.name}.weight: config.json says kv_b_proj is stored as {decision.stored.name}, but the "
            f"safetensors file holds {stored.format.value}; the config and the weights disagree"
        )


# stored FP8 format -> its split into (codes, scale) of W_UK and W_UV^T at the scales' real granularity
_FP8_SPLIT = {
    WeightFormat.FP8_BLOCK: split_kv_b_proj_fp8,
    WeightFormat.FP8_PER_TENSOR: split_kv_b_proj_fp8_scaled,
    WeightFormat.FP8_PER_CHANNEL: split_kv_b_proj_fp8_scaled,
}


def _mx_w_uv_t(stored: CheckpointWeight, n: int, p: int, v: int) -> MxTensor:
    """W_UV^T (N, L, V) of a Quark MXFP4 kv_b_proj, codes and E8M0 scales as stored (blocks along L)."""
    mx = MxTensor.from_packed(stored.codes, stored.scale, MxElem.E2M1, axis=-1)
    lora = mx.shape[1]
    codes = mx.codes.view(n, p + v, lora)[:, p:, :].transpose(1, 2)  # (N, V, L) -> (N, L, V)
    scales = mx.scales.view(n, p + v, -1)[:, p:, :].transpose(1, 2)  # (N, V, L/32) -> (N, L/32, V)
    return MxTensor(
        codes.contiguous(), scales.contiguous(), MxElem.E2M1, None, 1, mx.block_size, (n, lora, v)
    )
