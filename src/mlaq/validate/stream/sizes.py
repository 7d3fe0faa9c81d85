"""What a streamed run will hold and read, from the checkpoint's headers alone (nothing is read)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlaq.model.loading.layer_source import SLAB_ELEMENTS, LayerSource
from mlaq.model.loading.weights import DENSE_DTYPES
from mlaq.validate.config import Variant
from mlaq.validate.stream.budget import Shape, held_bytes

PREPARED_BYTES = 12  # prepared W_UK + W_UV^T of one variant, bytes per kv_b_proj element (measured: 9-12)


@dataclass(frozen=True)
class Sizes:
    layer: int  # the heaviest layer held (routed experts aside), every dtype, prepared BMMs included
    expert: int  # one routed expert held, every dtype
    head: int  # the lm_head held, every dtype
    total_read: int  # checkpoint bytes the run reads at most (every routed expert counted)
    per_layer_read: tuple[int, ...]  # the same per layer (main, then MTP)


def _elem(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _group(source: LayerSource, names: Sequence[str], dtype_bytes: tuple[int, ...]) -> tuple[int, int]:
    """(held bytes, stored bytes) of a group of tensors read together."""
    reader = source.reader
    infos = [reader.info(n) for n in names]
    numel = sum(math.prod(i.shape) for i in infos)
    stored = sum(i.nbytes for i in infos)
    largest = max(infos, key=lambda i: i.nbytes, default=None)
    if largest is None:
        return 0, 0
    # the transient of preparing the largest tensor: none for dense (cast from storage), one slab for
    # FP8 blocks, a whole fp32 copy for the other quantized formats (layer_source._dequantized)
    stored_largest = largest.nbytes
    if all(i.dtype in DENSE_DTYPES for i in infos):
        transient = 0
        if largest.dtype.itemsize in dtype_bytes:  # cast to its own dtype: the stored tensor is kept
            stored_largest = 0
    elif any(n.endswith("weight_scale_inv") for n in names):
        transient = min(math.prod(largest.shape), SLAB_ELEMENTS)
    else:
        transient = math.prod(largest.shape)
    return held_bytes(numel, stored_largest, transient, dtype_bytes), stored


def shape_and_sizes(
    source: LayerSource,
    variants: Sequence[Variant],
    windows: int,
    tokens: int,
    tasks: dict[str, int] | None = None,
) -> tuple[Shape, Sizes]:
    """``tasks``: the suite's part of the shape (stream/tasks.py ``task_shape``)."""
    cfg, mla = source.config, source.mla_config
    dtype_bytes = tuple(_elem(d) for d in dict.fromkeys(v.dtype for v in variants))
    kv_b = cfg.num_attention_heads * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank
    layer_held, expert_held, per_layer = 0, 0, []
    for i in range(source.num_layers):
        held, stored = _group(source, source.layer_names(i, experts=False), dtype_bytes)
        layer_held = max(layer_held, held + kv_b * PREPARED_BYTES * min(len(variants), 2))  # ref + one
        read = stored
        if source.is_moe(i):
            assert cfg.moe is not None
            for e in range(cfg.moe.n_routed_experts):
                e_held, e_stored = _group(source, source.expert_names(i, e), dtype_bytes)
                expert_held = max(expert_held, e_held)
                read += e_stored
        per_layer.append(read)
    head_name = source.head_name()
    head_numel = cfg.vocab_size * cfg.hidden_size
    head_stored = source.reader.nbytes(head_name)
    dense_head = source.reader.info(head_name).dtype in DENSE_DTYPES
    head = held_bytes(head_numel, head_stored, 0 if dense_head else head_numel, dtype_bytes)
    embed = (
        windows * tokens * cfg.hidden_size * source.reader.info("model.embed_tokens.weight").dtype.itemsize
    )
    total = sum(per_layer) + head_stored + embed
    moe = cfg.moe
    shape = Shape(
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        qk_nope=mla.qk_nope_head_dim,
        rope=mla.qk_rope_head_dim,
        lora=mla.kv_lora_rank,
        v_head=mla.v_head_dim,
        vocab=cfg.vocab_size,
        tokens=tokens,
        windows=windows,
        stream_bytes=tuple(_elem(v.dtype) for v in variants),
        variants=len(variants),
        index_heads=cfg.indexer.n_heads if cfg.indexer is not None else 0,
        experts_per_token=moe.num_experts_per_tok if moe is not None else 0,
        moe_intermediate=moe.moe_intermediate_size if moe is not None else 0,
        **(tasks or {}),
    )
    return shape, Sizes(layer_held, expert_held, head, total, tuple(per_layer))
