"""Tensor parallelism: a scheme run the way each rank of a ``--tensor-parallel-size N`` deployment runs it.

vLLM's kv_b_proj is a ColumnParallelLinear: its output dim ``num_heads * (P + V)`` is cut into N
contiguous pieces, so rank r holds heads ``[r*H/N, (r+1)*H/N)`` and splits its own W_UK / W_UV from its
shard (vllm/model_executor/layers/attention/mla_attention.py ``split_kv_b_proj`` on
``num_heads // tp_size`` heads). Every re-quantization the BMM kernels do at load reads only that shard:
AITER's ``dynamic_per_batched_tensor_quant`` takes one amax over the rank's (H/N, K, M) tensor, so
``fp8_per_tensor``'s single scale becomes one scale per shard. Schemes whose scales stay inside a head
(per head, per channel, MX blocks along K, 128x128 blocks) give the same bits either way.

:func:`shard_heads` wraps a scheme so that ``prepare`` quantizes each shard on its own and ``apply``
runs each rank's BMM on its heads' activations; the outputs are concatenated along the heads, as the
ranks' attention outputs are before o_proj (a RowParallelLinear) reduces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight, check_operands

# schemes without any scale: a shard's values are the whole tensor's, so sharding cannot change a bit
_SCALE_FREE = ("fp32", "bf16", "bf16_sm90")


def check_tp_size(tp_size: int, num_heads: int) -> None:
    """vLLM's refusal (vllm/config/model.py ``verify_with_parallel_config``), word for word in its shape."""
    if tp_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {tp_size}")
    if num_heads % tp_size != 0:
        raise ValueError(
            f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel size "
            f"({tp_size})."
        )


def spans_heads(scheme_name: str) -> bool:
    """Does the scheme compute a scale over more than one head (so a shard's scale differs)? The
    per-tensor FP8 schemes (AITER's and SGLang's); every other scheme's scales stay inside a head."""
    return scheme_name.startswith("fp8_per_tensor")


def head_shards(num_heads: int, tp_size: int) -> tuple[tuple[int, int], ...]:
    """[start, end) heads of each rank: ColumnParallelLinear's contiguous split of the output dim."""
    check_tp_size(tp_size, num_heads)
    per = num_heads // tp_size
    return tuple((r * per, (r + 1) * per) for r in range(tp_size))


@dataclass(frozen=True, eq=False)
class ShardedWeight(PreparedWeight):
    """One prepared weight per rank, each (H/N, K, M); ``shape`` is the whole (H, K, M)."""

    shards: tuple[PreparedWeight, ...] = ()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.cat([s.dequantize(dtype) for s in self.shards], dim=0)

    def storage_bytes(self) -> int:
        return sum(s.storage_bytes() for s in self.shards)


class TensorParallel(BmmScheme):
    """``inner`` run per rank over ``tp_size`` contiguous head shards; named as ``inner`` (the kernel is
    the same, only the tensor its scales are computed over changes)."""

    compiles_exactly = False  # eager: the per-shard loop is not among the pieces checked under inductor

    def __init__(self, inner: BmmScheme, tp_size: int) -> None:
        self.inner = inner
        self.tp_size = tp_size
        self.name = inner.name
        self.out_dtype = inner.out_dtype  # type: ignore[misc]
        self.batch_invariant = inner.batch_invariant  # type: ignore[misc]
        self.description = f"{inner.description}; scales computed per tensor-parallel shard of the heads"

    def _split(self, t: Tensor) -> tuple[Tensor, ...]:
        check_tp_size(self.tp_size, t.shape[0])
        return t.chunk(self.tp_size, dim=0)

    def prepare(self, weight: Tensor) -> PreparedWeight:
        # (H, K, M) -> tp_size x (H/N, K, M), each quantized with its own scales
        shards = tuple(self.inner.prepare(w.contiguous()) for w in self._split(weight))
        return ShardedWeight(self.name, tuple(weight.shape), shards)

    def prepare_shards(self, shards: tuple[PreparedWeight, ...]) -> ShardedWeight:
        """Wrap weights already prepared per rank (e.g. SGLang's whole-kv_b scale, one per shard)."""
        n = sum(s.shape[0] for s in shards)
        _, k, m = shards[0].shape
        return ShardedWeight(self.name, (n, k, m), shards)

    def _own(self, prepared: PreparedWeight) -> ShardedWeight:
        if not isinstance(prepared, ShardedWeight) or len(prepared.shards) != self.tp_size:
            raise ValueError(
                f"{self.name} at tensor-parallel size {self.tp_size} needs a weight prepared per shard, got "
                f"{type(prepared).__name__}"
            )
        return prepared

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        check_operands(x, prepared)
        w = self._own(prepared)
        # (H, B, K) -> per rank (H/N, B, K) @ (H/N, K, M) -> (H, B, M)
        return torch.cat(
            [self.inner.apply(xs, ws) for xs, ws in zip(self._split(x), w.shards, strict=True)], dim=0
        )

    def activation_values(self, x: Tensor) -> Tensor:
        return torch.cat([self.inner.activation_values(xs) for xs in self._split(x)], dim=0)


def shard_heads(scheme: BmmScheme, tp_size: int) -> BmmScheme:
    """``scheme`` as a ``tp_size``-way tensor-parallel deployment runs it (``scheme`` itself at size 1 and
    for the scale-free reference schemes, where the bits cannot differ)."""
    if tp_size == 1 or scheme.name in _SCALE_FREE:
        return scheme
    return TensorParallel(scheme, tp_size)
