"""vLLM 0.32's meaning of a ``targets`` entry on kv_b_proj: the kv_b_proj LINEAR is quantized online.

With ``--quantization online --quantization-config '{"targets": {"re:.*kv_b_proj": SCHEME}}'`` vLLM 0.32
makes kv_b_proj an online-quantized linear (vllm/model_executor/layers/quantization/online/): prefill
decompresses the latent cache through that linear, its activations (c_kv) quantized by the kernel, and the
MLA layer derives W_UK / W_UV from the layer's DEQUANTIZED weight (mla_attention.py ``split_kv_b_proj`` ->
quant_utils.py ``get_and_maybe_dequant_weights``), so decode's absorbed BMMs read it too. The arithmetic of
each scheme is in :mod:`mlaq.bmm.online_linear`; this module applies it to a layer (fp8_per_tensor,
fp8_per_channel, mxfp4, mxfp8; fp8_per_block is refused: its decode weight is read through an unpinned GEMM):

- :func:`online_kv_b`: the prefill linear (weight quantized, activations quantized as the sm90 kernel does)
  and the [out, in] weight the BMMs are split from, in the activation dtype.
- Tensor parallelism: fp8_per_tensor's amax is all-reduced (MAX) over the ranks by vLLM
  (``amax_for_tp_weight_quant``: a per-tensor amax reduces the dim a ColumnParallelLinear shards), so every
  rank gets the WHOLE weight's scale; the other schemes' scales are per row or per block of a rank's own
  shard (fp8_per_block's 128-row blocks start at each shard's first row), computed shard by shard here.
- The kernels emulated are those vLLM 0.32 picks on CUDA sm90 (H100 / H200); ``--platform`` ROCm or cpu is
  refused (:func:`mlaq.bmm.online_linear.check_platform`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaq.bmm.online_linear import (
    EMULATED,
    SCHEMES,
    Act,
    OnlineLinear,
    QuantizedWeight,
    check_platform,
    check_scheme,
    decode_weight,
    quantize_weight,
)
from mlaq.model.layers.mla_core import Precision

__all__ = [
    "EMULATED",
    "check_online_precision",
    "check_platform",
    "check_scheme",
    "online_dequantized",
    "online_fp8_per_tensor",
    "online_kv_b",
]


def check_online_precision(precision: Precision) -> None:
    """Under vLLM's meaning prefill runs the online linear: mlaq's ``--precision`` (prefill's arithmetic
    under mlaq's meaning) cannot apply as well; anything but the default is a clear error."""
    if precision is not Precision.DECODE_ONLY:
        raise ValueError(
            f"--precision {precision.value}: "
            "under --quantization online prefill runs vLLM's online kv_b_proj linear (vLLM's meaning); --precision "
            "chooses prefill's weights under mlaq's meaning (the absorbed BMMs): drop one of them"
        )


def online_fp8_per_tensor(weight: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(e4m3fn codes [out, in], fp32 0-d scale) of a kv_b_proj weight as vLLM 0.32's online fp8_per_tensor
    quantizes it. ``amax``: the whole weight's (a rank's shard passes the MAX over all ranks, as vLLM's
    all-reduce gives it); default: this weight's own."""
    q = quantize_weight(weight, "fp8_per_tensor", amax)
    return q.codes.float().to(torch.float8_e4m3fn), q.scales[0, 0].float()


def online_weights(weight: Tensor, online: str, tp: int = 1) -> list[QuantizedWeight]:
    """The per-rank quantized shards of a [out, in] kv_b_proj weight (rows split in ``tp`` equal shards)."""
    check_scheme(online)
    w = weight.detach().to(torch.bfloat16)
    amax = w.abs().amax() if online == "fp8_per_tensor" else None  # the all-reduced amax
    return [quantize_weight(shard, online, amax) for shard in w.chunk(tp, dim=0)]


def online_dequantized(weight: Tensor, online: str, dtype: torch.dtype, amax: Tensor | None = None) -> Tensor:
    """kv_b_proj's weight as vLLM 0.32 dequantizes it after the online ``online`` quantization, in ``dtype``
    (the activation dtype: what split_kv_b_proj hands the MLA layer); ``amax`` as in
    :func:`online_fp8_per_tensor` (the others' scales are local to a row or block)."""
    check_scheme(online)
    return decode_weight(quantize_weight(weight, online, amax), dtype)


class ShardedOnlineLinear:
    """Prefill's kv_b_proj under tensor parallelism: each rank's online linear on its rows, concatenated."""

    def __init__(self, parts: list[OnlineLinear]) -> None:
        self.parts = tuple(parts)

    def __call__(self, x: Tensor) -> Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def online_kv_b(
    weight: Tensor, online: str, dtype: torch.dtype, tp: int = 1, act: Act | None = None
) -> tuple[ShardedOnlineLinear, Tensor]:
    """(prefill's kv_b_proj linear, the [out, in] weight in ``dtype`` the BMMs are split from).

    ``act``: the activation quantization (default: the sm90 kernel's for the scheme); Act.NONE shows what
    it adds."""
    shards = online_weights(weight, online, tp)
    run = SCHEMES[online] if act is None else act
    linear = ShardedOnlineLinear([OnlineLinear(q, run) for q in shards])
    return linear, torch.cat([decode_weight(q, dtype) for q in shards], dim=0)
