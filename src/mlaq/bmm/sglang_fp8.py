"""SGLang 0.5.23's FP8 arithmetic for the absorbed MLA BMMs (w_kc = W_UK, w_vc = W_UV^T).

Read from the sglang 0.5.23 wheel:

* Weights: ``input_to_float8`` (srt/layers/quantization/fp8_utils.py), called on the WHOLE kv_b_proj
  weight before it is split into w_kc / w_vc (srt/models/deepseek_common/deepseek_weight_loader.py
  ``post_load_weights``: GLM-5's bf16 kv_b_proj on gfx950, and ``block_quant_to_tensor_quant`` /
  ``channel_quant_to_tensor_quant`` for FP8 checkpoints off CUDA), so W_UK and W_UV share ONE scale:
  ``amax = max(|min|, |max|)`` in fp32 floored at 1e-12, ``s = fp_max / amax`` (torch evaluates a
  Python float over a tensor as ``reciprocal(amax) * fp_max``: two fp32 roundings), codes =
  ``cast(clamp(x.float() * s, ±fp_max))``, dequant scale ``reciprocal(s)`` (fp32). ``fp_max`` is 448
  for e4m3fn and SGLang's own 224 for e4m3fnuz (sglang/kernels/ops/quantization/fp8_kernel.py).
  ``prepare`` on one (N, K, M) weight applies it to that weight alone; the loader
  (``mlaq.model.loading.kv_b``) quantizes the whole kv_b_proj with :func:`sglang_input_to_float8` instead.
* ``fp8_per_tensor_sglang[_fnuz]``: AITER's Triton a8w8 BMM, the kernel vLLM's AITER FP8 BMM uses
  (forward_mla_rocm.py ``rocm_absorb_q_bmm`` / ``rocm_absorb_v_bmm``: gfx950 with SGLANG_USE_AITER=1;
  on gfx942 only W_UK's BMM, and only inside CUDA graphs): activations per token per 128 along K.
* ``fp8_per_tensor_w8a16_sglang[_fnuz]``: ``torch.bmm(x.bf16, w.to(bf16) * w_scale)`` (forward_mla_rocm.py
  ``_absorb_weight_bf16``; forward_mla.py's ``_is_cpu`` branch): the weight dequantized to bf16 (the
  product formed in fp32 from the fp32 0-dim scale, as torch does on the CPU), bf16 GEMM, bf16 output.
* ``fp8_per_tensor_batch_sglang``: CUDA's ``bmm_fp8`` after ``per_tensor_quant_mla_fp8``
  (forward_mla.py; kernel in fp8_kernel.py): ONE activation scale for the whole (heads, tokens, K)
  batch, ``max(amax, 1e-12) / fp8_max``, codes ``cast(clamp(x * (1 / scale)))``; output
  ``bf16(dot * (a_scale * w_scale))``. A token's result depends on the other tokens of its batch.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from mlaq.bmm.base import check_operands
from mlaq.bmm.fp8 import Fp8Weight, _AiterFp8Scheme, _check_weight, _Fp8Scheme, _make_weight
from mlaq.formats import Fp8Dtype, fp8_cast

SGLANG_FNUZ_MAX = 224.0  # fp8_kernel.py: ``fp8_max = 224.0`` when is_fp8_fnuz() (gfx94x)
INPUT_AMAX_FLOOR = 1e-12  # input_to_float8's ``clamp(min=1e-12)``
MLA_ACT_EPS = 1e-12  # per_tensor_quant_mla_fp8's ``eps``


def sglang_fp8_max(dtype: Fp8Dtype) -> float:
    """SGLang's fp8_max: 448 for e4m3fn, 224 (not e4m3fnuz's 240) for e4m3fnuz."""
    return SGLANG_FNUZ_MAX if dtype is Fp8Dtype.E4M3FNUZ else dtype.max


def sglang_input_to_float8(x: Tensor, dtype: Fp8Dtype) -> tuple[Tensor, Tensor]:
    """SGLang's ``input_to_float8`` on a whole tensor: (fp8 codes, fp32 0-dim dequant scale)."""
    fp_max = sglang_fp8_max(dtype)
    amax = x.detach().abs().amax().float().clamp(min=INPUT_AMAX_FLOOR)  # = max(|min|, |max|), exact
    s = amax.reciprocal() * fp_max  # `fp_max / amax` as torch evaluates it
    codes = (x.detach().float() * s).clamp(min=-fp_max, max=fp_max)
    return fp8_cast(codes, dtype), s.reciprocal()


def sglang_mla_act_quant(x: Tensor, dtype: Fp8Dtype) -> tuple[Tensor, Tensor]:
    """``per_tensor_quant_mla_fp8`` on (N, B, K): (fp32 code values, fp32 0-dim scale) for the whole batch."""
    fp_max = sglang_fp8_max(dtype)
    xf = x.to(torch.bfloat16).float()
    # stage 1: atomic max over rows of max(row amax, eps) / fp8_max = max(amax, eps) / fp8_max (monotone)
    scale = xf.abs().amax().clamp(min=MLA_ACT_EPS) / torch.tensor(fp_max, device=xf.device)
    codes = fp8_cast((xf * (1.0 / scale)).clamp(-fp_max, fp_max), dtype)  # stage 2: x * (1 / x_s)
    return codes.float(), scale


class _SglangWeight(_Fp8Scheme):
    """One scale for the whole weight, quantized as SGLang's input_to_float8."""

    def prepare(self, weight: Tensor) -> Fp8Weight:
        _check_weight(weight, self.name)
        codes, scale = sglang_input_to_float8(weight, self.dtype)
        return _make_weight(self.name, codes, scale.reshape(1, 1, 1), (0, weight.shape[1]), self.dtype)

    def prepare_quantized(self, codes: Tensor, scale: Tensor) -> Fp8Weight:
        """Codes and ONE fp32 dequant scale, e.g. W_UK's or W_UV^T's share of a whole kv_b_proj
        quantized by :func:`sglang_input_to_float8` (``mlaq.bmm.split_kv_b_proj_fp8_scaled`` splits it)."""
        self._check_stored(codes, scale)
        if scale.numel() != 1:
            raise ValueError(f"{self.name}: one scale for the whole tensor, got shape {tuple(scale.shape)}")
        return _make_weight(self.name, codes, scale.reshape(1, 1, 1), (0, codes.shape[1]), self.dtype)


class Fp8PerTensorSglang(_SglangWeight, _AiterFp8Scheme):
    base_name = "fp8_per_tensor_sglang"
    reduce_dims = (0, 1, 2)
    granularity = "one scale for the whole tensor"
    compiles_exactly = False
    arithmetic = (
        "SGLang on ROCm with AITER: {dtype} weight with ONE scale for the whole kv_b_proj (SGLang "
        "input_to_float8: fp32 scale {max}/amax), AITER's a8w8 BMM: activations per token per 128 along K, "
        "per-group code dot products times the activation scale accumulated in fp32, times the weight "
        "scale, bf16 output"
    )


class Fp8PerTensorW8A16Sglang(_SglangWeight):
    base_name = "fp8_per_tensor_w8a16_sglang"
    compiles_exactly = False
    arithmetic = (
        "SGLang's torch.bmm fallback: {dtype} weight with ONE scale for the whole kv_b_proj (SGLang "
        "input_to_float8), dequantized to bf16 (code x fp32 scale, rounded once), bf16 activations, fp32 "
        "accumulation, bf16 output"
    )

    def dequantized_bf16(self, w: Fp8Weight) -> Tensor:
        """``w.to(torch.bfloat16) * w_scale``: the fp32 product of a code and the scale, rounded to bf16."""
        return (w.codes.float() * w.scale).to(torch.bfloat16)

    def apply(self, x: Tensor, prepared: Fp8Weight) -> Tensor:  # type: ignore[override]
        check_operands(x, prepared)
        w = self.dequantized_bf16(self._weight(prepared)).double()
        return torch.bmm(x.to(torch.bfloat16).double(), w).float().to(torch.bfloat16).float()

    def activation_values(self, x: Tensor) -> Tensor:
        return x.to(torch.bfloat16).double()


class Fp8PerTensorBatchSglang(_SglangWeight):
    """Not batch invariant: the activation scale is the whole batch's amax."""

    base_name = "fp8_per_tensor_batch_sglang"
    batch_invariant: ClassVar[bool] = False
    compiles_exactly = False
    arithmetic = (
        "SGLang on CUDA (bmm_fp8): {dtype} weight with ONE scale for the whole kv_b_proj, activations with "
        "ONE scale for the whole batch of heads and tokens (amax/{max}, per_tensor_quant_mla_fp8), code dot "
        "products in fp32 times (activation scale x weight scale), bf16 output"
    )

    def apply(self, x: Tensor, prepared: Fp8Weight) -> Tensor:  # type: ignore[override]
        check_operands(x, prepared)
        w = self._weight(prepared)
        xq, xs = sglang_mla_act_quant(x, self.dtype)
        acc = torch.bmm(xq.double(), w.values).float()  # exact code dots, rounded once to fp32
        return (acc * (xs * w.scale)).to(torch.bfloat16).float()

    def activation_values(self, x: Tensor) -> Tensor:
        xq, xs = sglang_mla_act_quant(x, self.dtype)
        return xq.double() * xs.double()


SGLANG_FP8 = (Fp8PerTensorSglang, Fp8PerTensorW8A16Sglang, Fp8PerTensorBatchSglang)


def sglang_kv_b_proj(
    scheme_uk: _SglangWeight,
    scheme_uv: _SglangWeight,
    weight: Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
) -> tuple[Fp8Weight, Fp8Weight]:
    """(W_UK, W_UV^T) prepared from a whole kv_b_proj ``weight`` [N*(P+V), L] as SGLang does it: ONE
    ``input_to_float8`` over the whole weight, then split (deepseek_weight_loader.py post_load_weights), so
    both halves share its scale. The two schemes must use the same FP8 dtype (they read the same codes)."""
    if scheme_uk.dtype is not scheme_uv.dtype:
        raise ValueError(
            f"{scheme_uk.name} and {scheme_uv.name} cannot share one kv_b_proj: FP8 dtypes differ"
        )
    codes, scale = sglang_input_to_float8(weight, scheme_uv.dtype)  # [N*(P+V), L], one scale
    per_head = codes.view(num_heads, qk_nope_head_dim + v_head_dim, -1)  # (N, P+V, L)
    uk, uv = per_head.split([qk_nope_head_dim, v_head_dim], dim=1)  # (N, P, L), (N, V, L)
    return (
        scheme_uk.prepare_quantized(uk.contiguous(), scale),
        scheme_uv.prepare_quantized(uv.transpose(1, 2).contiguous(), scale),  # W_UV^T (N, L, V)
    )


def whole_kv_b(scheme: object) -> bool:
    """Does this scheme quantize the whole kv_b_proj at once (SGLang), rather than each BMM weight?"""
    return isinstance(scheme, _SglangWeight)
