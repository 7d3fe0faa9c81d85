"""The absorbed BMMs' weights of one MLA layer: kv_b_proj split into W_UK / W_UV^T and prepared with a
scheme (``prepare_absorbed``), already-prepared weights checked and installed (``installed_absorbed``),
and the check that the weights still belong to the kv_b_proj they were split from (``checked_absorbed``).

``MLAttention.prepare`` / ``set_absorbed`` are the front door; these functions hold their rules.
"""

from __future__ import annotations

from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.bmm.kv_b import split_kv_b_proj
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.mla_core import AbsorbedWeights, Precision


def prepare_absorbed(
    config: MLAConfig, kv_b_weight: Tensor, scheme: BmmScheme, precision: Precision
) -> AbsorbedWeights:
    """kv_b_proj's weight (N*(P+V), L) split into W_UK (N, P, L) and W_UV^T (N, L, V), each prepared
    (quantized) by ``scheme``; remembers which tensor (and which version of it) it was split from."""
    c = config
    w_uk, w_uv_t = split_kv_b_proj(kv_b_weight.float(), c.num_heads, c.qk_nope_head_dim, c.v_head_dim)
    source = (kv_b_weight.data_ptr(), kv_b_weight._version)
    prepared = scheme.prepare(w_uk.contiguous()), scheme.prepare(w_uv_t.contiguous())
    return AbsorbedWeights(*prepared, scheme, scheme, precision, source)


def installed_absorbed(
    config: MLAConfig,
    w_uk: PreparedWeight,
    w_uv: PreparedWeight,
    scheme: BmmScheme,
    scheme_uv: BmmScheme | None,
    precision: Precision,
) -> AbsorbedWeights:
    """Already-prepared weights checked against the layer's shapes and their schemes (a clear error
    names the one that does not fit): ``w_uk`` (N, P, L) for ``scheme``, ``w_uv`` = W_UV^T (N, L, V)
    for ``scheme_uv`` (default: ``scheme``)."""
    c = config
    sch_uv = scheme if scheme_uv is None else scheme_uv
    want = {
        "w_uk": ((c.num_heads, c.qk_nope_head_dim, c.kv_lora_rank), w_uk, scheme),
        "w_uv": ((c.num_heads, c.kv_lora_rank, c.v_head_dim), w_uv, sch_uv),
    }
    for name, (shape, w, sch) in want.items():
        if tuple(w.shape) != shape:
            raise ValueError(f"set_absorbed: {name} has shape {tuple(w.shape)}, expected (N, K, M) = {shape}")
        if w.scheme != sch.name:
            raise ValueError(
                f"set_absorbed: {name} was prepared by {w.scheme!r} but is given to {sch.name!r}"
            )
    return AbsorbedWeights(w_uk, w_uv, scheme, sch_uv, precision, None)


def checked_absorbed(absorbed: AbsorbedWeights | None, kv_b_weight: Tensor) -> AbsorbedWeights:
    """``absorbed``, or a clear error when there is none yet or kv_b_proj changed since it was split."""
    if absorbed is None:
        raise ValueError(
            "absorbed path: no W_UK/W_UV yet; call prepare(scheme) or set_absorbed(...) after loading weights"
        )
    w = kv_b_weight
    if absorbed.source is not None and absorbed.source != (w.data_ptr(), w._version):
        raise ValueError("kv_b_proj.weight changed after prepare(); call prepare() again")
    return absorbed
