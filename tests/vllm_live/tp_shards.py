"""Run in vLLM's environment (tests/test_vllm_plugin_live.py does): vLLM 0.32's own tensor-parallel weight
loading of kv_b_proj, rank by rank in one process, against mlaq's ``--tensor-parallel-size``.

    python tests/vllm_live/tp_shards.py MODEL_DIR     # prints one JSON list of mismatches ([] when none)

For N in 2 and 4 and every rank r: vLLM's ``ColumnParallelLinear`` built with ``tp_rank=r, tp_size=N``
(the arguments vLLM's own layers use to shard at another granularity) loads the checkpoint's kv_b_proj
through its ``weight_loader``; ``split_kv_b_proj`` (mla_attention.py, as ``process_weights_after_loading``
calls it with the rank's ``num_heads // N`` heads) gives W_UK / W_UV; AITER's re-quantizer
``dynamic_per_batched_tensor_quant`` gives the rank's FP8 codes and scale. They must equal, bit for bit:
mlaq's ``load_model(..., tensor_parallel_size=N)`` shard r (bf16 W_UK / W_UV^T and fp8_per_tensor codes
and scale), and the plugin's emulated weight built from vLLM's rank-local W_UK_T / W_UV.
"""

from __future__ import annotations

import json
import sys

import torch

from mlaq.bmm import get_scheme
from mlaq.integrations.vllm.emulate import emulated
from mlaq.model import load_model
from mlaq.model.loading.checkpoint import SafetensorsCheckpoint

FP8 = '{"targets": {"re:.*kv_b_proj": "fp8_per_tensor"}}'


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def rank_weights(stored: torch.Tensor, r: int, n: int, heads: int, p: int, v: int):
    """vLLM's W_UK (L, H/N, P), W_UV (L, H/N, V) on rank r of n."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.mla_attention import split_kv_b_proj
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    out, lora = stored.shape
    with set_current_vllm_config(VllmConfig()):
        layer = ColumnParallelLinear(
            lora, out, bias=False, params_dtype=torch.bfloat16, tp_rank=r, tp_size=n, prefix="kv_b_proj"
        )
    layer.weight.weight_loader(layer.weight, stored)  # narrows to rank r's rows (weight_loader[_v2])
    return split_kv_b_proj(layer, torch.bfloat16, lora, heads // n, p, v)


def one_process_group() -> None:
    """A TP group of one process (gloo), as vLLM's own layer tests set it up: the parameters ask for the
    global rank when built; the layer's ``tp_rank`` / ``tp_size`` then decide which rows it loads."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1)


def main(model_dir: str) -> list[str]:
    from vllm.model_executor.layers.attention.mla_attention import dynamic_per_batched_tensor_quant

    one_process_group()
    bad: list[str] = []
    base = load_model(model_dir)
    c = base.model.layers[0].self_attn.config
    heads, p, v = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    with SafetensorsCheckpoint(model_dir) as ckpt:
        stored = {
            i: ckpt.get(f"model.layers.{i}.self_attn.kv_b_proj.weight") for i in range(len(base.model.layers))
        }
    scheme = get_scheme("fp8_per_tensor")
    for n in (2, 4):
        fp8 = load_model(model_dir, quantization_config=FP8, tensor_parallel_size=n)
        for i, w in stored.items():
            for r in range(n):
                W_UK, W_UV = rank_weights(w, r, n, heads, p, v)
                uk_t, uv = (
                    W_UK.permute(1, 2, 0),
                    W_UV.transpose(0, 1),
                )  # vLLM's W_UK_T (n, P, L), W_UV (n, L, V)
                a, b = r * heads // n, (r + 1) * heads // n
                where = f"tp {n} rank {r} layer {i}"
                mine = base.model.layers[i].self_attn.absorbed  # bf16: no scale, the same at any size
                if not _same(uk_t, mine.w_uk.weight[a:b]) or not _same(uv, mine.w_uv.weight[a:b]):
                    bad.append(f"{where}: bf16 W_UK_T / W_UV differ from vLLM's shard")
                ab = fp8.model.layers[i].self_attn.absorbed
                for name, theirs, ours, layout in (
                    ("W_K", W_UK.transpose(0, 1), ab.w_uk.shards[r], (0, 2, 1)),  # vLLM (n, L, P)
                    ("W_V", W_UV.permute(1, 2, 0), ab.w_uv.shards[r], (0, 2, 1)),  # vLLM (n, V, L)
                ):
                    codes, scale = dynamic_per_batched_tensor_quant(theirs, torch.float8_e4m3fn)
                    if not _same(codes.permute(*layout).contiguous(), ours.codes):
                        bad.append(f"{where}: {name} fp8 codes differ from AITER's on vLLM's shard")
                    if scale.reshape(()).item() != ours.scale.reshape(()).item():
                        bad.append(f"{where}: {name} scale {ours.scale.item()} != vLLM's {scale.item()}")
                for name, local, ours in (
                    ("W_UK_T", uk_t, ab.w_uk.shards[r]),
                    ("W_UV", uv, ab.w_uv.shards[r]),
                ):
                    plugin = emulated(scheme, local, name).prepared  # the plugin's weight on this rank
                    if not _same(plugin.codes, ours.codes) or not _same(plugin.scale, ours.scale):
                        bad.append(f"{where}: the plugin's {name} differs from mlaq's shard")
    return bad


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
