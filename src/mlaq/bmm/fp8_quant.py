"""The FP8 quantizers of the engines' BMM paths, bit for bit, where they differ from ``mlaq.formats``.

``mlaq.formats.quantize_fp8`` is the DeepSeek-V3 arithmetic (scale = amax / max in fp32, codes =
cast(x / scale)); the AMD/vLLM FP8 BMM path does two things differently, so they are emulated here:

* vLLM ``dynamic_per_batched_tensor_quant`` (weights, at load) works in the weight's dtype, bf16:
  ``scale = 448 / amax`` is a bf16 tensor (torch evaluates ``scalar / tensor`` as
  ``tensor.reciprocal() * scalar``: two bf16 roundings), ``w * scale`` is rounded to bf16, clamped,
  then cast to fp8; the dequant multiplier is ``scale.float().reciprocal()`` (fp32). We run the same
  torch expression, so the emulation follows torch's own semantics.
* AITER's Triton FP8 BMM quantizes the activations inside the kernel, per token per 128 along K:
  ``a_scale = max(amax, 1e-10) * fp32(1/448)``, codes = ``cast(clamp(x * fp32(1 / a_scale)))``:
  a multiply by a rounded reciprocal, not a division.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mlaq.formats import Fp8Dtype, fp8_cast, quantize_fp8_per_token_group

FP8_GROUP = 128  # K-group of the activations (AITER group_size=128, DeepSeek-V3 1x128)


def vllm_batched_tensor_quant(
    weight: Tensor, dtype: Fp8Dtype, reduce_dims: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """vLLM's ``dynamic_per_batched_tensor_quant`` with the amax taken over ``reduce_dims``.

    ``reduce_dims`` = all dims is vLLM's (one scale for the whole tensor); fewer dims give the
    per-head / per-channel variants with the same arithmetic. Returns (fp8 codes, fp32 dequant scale
    with the reduced dims kept as size 1).
    """
    w = weight.detach().to(torch.bfloat16)  # vLLM quantizes the bf16 (or dequantized-to-bf16) weight
    fp8_max = dtype.max
    amax = w.abs().amax(dim=reduce_dims, keepdim=True)  # = max(|aminmax|), exact in bf16
    amax = amax.clamp(min=1e-10)
    scale = fp8_max / amax  # bf16 tensor: reciprocal then multiply, as torch does it
    q = (w * scale).clamp(min=-fp8_max, max=fp8_max)  # bf16 product, rounded before the cast
    return q.to(dtype.torch_dtype), scale.float().reciprocal()


def aiter_token_group_quant(x: Tensor, dtype: Fp8Dtype, group: int = FP8_GROUP) -> tuple[Tensor, Tensor]:
    """AITER's in-kernel activation quantization: (N, B, K) bf16 -> (fp32 codes, fp32 scales (N, B, G)).

    The ragged tail group is masked to zeros in the kernel, which never raises its amax.
    """
    n, b, k = x.shape
    g = math.ceil(k / group)
    xf = torch.nn.functional.pad(x.to(torch.bfloat16).float(), (0, g * group - k))
    xg = xf.reshape(n, b, g, group)  # (N, B, K) -> (N, B, G, 128)
    m = xg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    one_over_max = torch.tensor(
        1.0 / dtype.max, dtype=torch.float32, device=x.device
    )  # a constexpr, rounded to fp32
    a_scale = m * one_over_max
    a_recip = 1.0 / a_scale  # fp32 division, as Triton's `1.0 / a_scale`
    codes = fp8_cast(xg * a_recip, dtype).float()
    return codes.reshape(n, b, g * group)[..., :k], a_scale.squeeze(-1)


def vllm_token_group_quant(x: Tensor, dtype: Fp8Dtype, group: int = FP8_GROUP) -> tuple[Tensor, Tensor]:
    """vLLM's Triton ``_per_token_group_quant_fp8`` (vLLM 0.32 utils/fp8_utils.py): per token per ``group``
    along K, ``scale = max(amax, 1e-10) * fp32(1 / max)`` (multiply by the rounded reciprocal, not
    ``amax / max``), codes = ``cast(clamp(x / scale))`` (a true division). The ragged tail group is
    masked to zeros, as the kernel's masked load does.

    (N, B, K) -> (fp32 codes (N, B, K), fp32 scales (N, B, G)).
    """
    n, b, k = x.shape
    g = math.ceil(k / group)
    xf = torch.nn.functional.pad(x.to(torch.bfloat16).float(), (0, g * group - k))
    xg = xf.reshape(n, b, g, group)  # (N, B, K) -> (N, B, G, group)
    m = xg.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10)
    one_over_max = torch.tensor(
        1.0 / dtype.max, dtype=torch.float32, device=x.device
    )  # `1.0 / fp8_max`, a constexpr
    scale = m * one_over_max
    codes = fp8_cast(xg / scale, dtype).float()
    return codes.reshape(n, b, g * group)[..., :k], scale.squeeze(-1)


def deepseek_token_group_quant(x: Tensor, dtype: Fp8Dtype, group: int = FP8_GROUP) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 ``act_quant`` (inference/kernel.py): scale = amax / max, codes = x / scale (both true
    fp32 divisions; vLLM's Triton group quant differs, see :func:`vllm_token_group_quant`).

    (N, B, K) -> (fp32 codes (N, B, K), fp32 scales (N, B, G)); ragged tail group has its own scale.
    """
    t = quantize_fp8_per_token_group(x.to(torch.bfloat16).float(), dtype, group)
    return t.codes.float(), t.scale
