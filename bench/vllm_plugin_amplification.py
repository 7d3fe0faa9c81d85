"""How much does each BMM scheme magnify a floor-sized difference upstream of it? mlaq's engine alone.

    python bench/vllm_plugin_amplification.py --schemes fp8_per_tensor mxfp4

Two correct bf16 engines (vLLM, mlaq) differ by about one bf16 ulp here and there in every activation;
bench/vllm_plugin_ab.py measures what that costs end to end (the "floor": KL per position between the
engines, both bf16). With a scheme emulated in both engines the same upstream differences reach the
scheme's BMM inputs, and a scheme that rounds its activations (mxfp4: E2M1 per 32-block; fp8_per_tensor:
E4M3 with one scale) can move a whole rounding step where bf16 moves one ulp. This script reproduces
that in mlaq alone: the same random prompts as bench/vllm_plugin_ab.py, teacher-forced through the
absorbed (decode) path, once clean and once with the token embeddings multiplied by ``1 + eps * z``
(z standard normal, fixed seed, rounded back to bf16: a floor-like perturbation that every layer then
carries), for ``bf16`` and each scheme. Printed per eps: KL(clean || perturbed) per position, mean ±
standard error over positions, and each scheme's KL divided by bf16's (the amplification); the eps
whose bf16 KL is nearest --floor is the like-for-like of the floor.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from mlaq.model import ModelCache
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_core import Precision
from mlaq.model.loading.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_plugin_ab import BUNDLED, TARGETS, prompts


def logprobs(model: torch.nn.Module, ids: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    """(P, T, V) float32 log-probabilities, the embeddings perturbed by ``eps`` (0: clean)."""
    gen = torch.Generator().manual_seed(seed)

    def perturb(_m: torch.nn.Module, _a: tuple, out: torch.Tensor) -> torch.Tensor:
        z = torch.randn(out.shape, generator=gen)
        return (out.float() * (1 + eps * z)).to(out.dtype)

    hook = model.model.embed_tokens.register_forward_hook(perturb) if eps else None
    try:
        with torch.inference_mode():
            rows = [model(row[None], ModelCache(), path=AttnPath.ABSORBED).logits[0] for row in ids]
    finally:
        if hook is not None:
            hook.remove()
    return torch.stack(rows).float().log_softmax(-1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--schemes", nargs="+", default=["fp8_per_tensor", "mxfp4"])
    p.add_argument("--eps", nargs="+", type=float, default=[2**-11, 2**-10, 2**-9, 2**-8, 2**-7])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=80)
    p.add_argument("--floor", type=float, default=8.0e-5, help="the engines' bf16 KL to match")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    ids = torch.tensor(prompts(args.prompts, args.prompt_len, vocab))
    names = ["bf16", *args.schemes]
    kl: dict[float, dict[str, tuple[float, float]]] = {e: {} for e in args.eps}
    for name in names:
        qc = json.dumps({"targets": {TARGETS: name}})
        model = load_model(
            args.model, dtype=torch.bfloat16, quantization_config=qc, precision=Precision.CONSISTENT
        )
        clean = logprobs(model, ids, 0.0, args.seed)
        for e in args.eps:
            pert = logprobs(model, ids, e, args.seed)
            per_pos = (clean.exp() * (clean - pert)).sum(-1).flatten()
            kl[e][name] = (float(per_pos.mean()), float(per_pos.std() / per_pos.numel() ** 0.5))
        print(f"{name}: done", file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps({str(e): v for e, v in kl.items()}, indent=1))
    n = ids.numel()
    lines = [
        f"| eps | bf16 KL (n={n}) | " + " | ".join(f"{s} KL / x bf16" for s in args.schemes) + " |",
        "|---|---|" + "---|" * len(args.schemes),
    ]
    nearest = min(args.eps, key=lambda e: abs(kl[e]["bf16"][0] - args.floor))
    for e in args.eps:
        b = kl[e]["bf16"]
        cells = [
            f"{kl[e][s][0]:.2e} ± {kl[e][s][1]:.1e} / " + (f"{kl[e][s][0] / b[0]:.1f}x" if b[0] else "n/a")
            for s in args.schemes
        ]
        mark = " (nearest the floor)" if e == nearest else ""
        lines.append(
            f"| 2^{torch.tensor(e).log2().item():.0f}{mark} | {b[0]:.2e} ± {b[1]:.1e} | "
            + " | ".join(cells)
            + " |"
        )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
