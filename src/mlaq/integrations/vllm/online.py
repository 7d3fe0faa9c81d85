"""The plugin's ``"quantization": "online"``: vLLM 0.32's meaning of targets, the kv_b_proj LINEAR quantized
online, emulated as mlaq's engine does it (:mod:`mlaq.model.loading.online`, :mod:`mlaq.bmm.online_linear`).

Before vLLM's own ``process_weights_after_loading`` splits W_UK / W_UV from kv_b_proj, its weight becomes the
online scheme's dequantized weight (what vLLM's ``get_and_maybe_dequant_weights`` hands the split), so vLLM's
BMMs read it; and the layer's prefill GEMM (``kv_b_proj.quant_method.apply``) becomes the online linear: the
quantized weight with the sm90 kernel's activation quantization (per-token FP8 of c_kv for fp8_per_tensor
and fp8_per_channel; none for the weight-only MX kernels). Under tensor parallelism fp8_per_tensor's amax is the MAX over the
ranks, as vLLM's ``amax_for_tp_weight_quant`` all-reduces it; the MX scales are local to a rank's rows.
"""

from __future__ import annotations

from typing import Any

import torch

from mlaq.bmm.online_linear import SCHEMES, OnlineLinear, check_scheme, decode_weight, quantize_weight


def apply_online(layer: Any, online: str) -> None:
    """Install vLLM's meaning of ``online`` on one MLA layer (called from the layer's constructor hook)."""
    check_scheme(online)
    vllm_process = layer.process_weights_after_loading

    def process_weights_after_loading(act_dtype: torch.dtype) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

        kv_b = layer.kv_b_proj.weight
        if kv_b.dtype not in (torch.bfloat16, torch.float16):
            raise RuntimeError(
                f"mlaq plugin: {layer.layer_name}: quantization online quantizes an unquantized kv_b_proj; "
                f"this one is stored {kv_b.dtype}"
            )
        amax = kv_b.detach().abs().amax().reshape(1)
        if online == "fp8_per_tensor" and get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(  # amax_for_tp_weight_quant
                amax, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group
            )
        quantized = quantize_weight(kv_b.data, online, amax)
        kv_b.data.copy_(decode_weight(quantized, kv_b.dtype))
        prefill = OnlineLinear(quantized, SCHEMES[online])
        method = getattr(layer.kv_b_proj, "quant_method", None)
        if method is not None:  # the layer's own instance: vLLM's prefill GEMM runs the online linear
            method.apply = lambda _layer, x, bias=None: prefill(x) if bias is None else prefill(x) + bias
        vllm_process(act_dtype)

    layer.process_weights_after_loading = process_weights_after_loading
