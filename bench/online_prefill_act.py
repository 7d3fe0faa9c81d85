"""What prefill's activation quantization adds under vLLM's meaning of targets (``--quantization online``).

    python bench/online_prefill_act.py --prompts 4 --prompt-len 128

The bundled model teacher-forced through prefill (the naive path, where kv_b_proj's online linear runs), for
each online scheme: KL(bf16 || online) per position with the sm90 kernel's activation quantization of c_kv
(as vLLM runs it) and with it turned off (the same quantized weight, bf16 activations), and KL between the
two. Mean ± standard error over positions (positions of one prompt are not independent: the error is too
narrow), n = prompts * prompt_len.
"""

from __future__ import annotations

import argparse
import json

import torch

from mlaq.bmm import scheme_names
from mlaq.bmm.online_linear import EMULATED, Act
from mlaq.bundled import bundled_model_dir
from mlaq.model.layers.mla import AttnPath
from mlaq.model.loading.loader import load_model
from mlaq.model.loading.online import online_kv_b
from mlaq.policy import load_explicit


def _kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    p, q = p_logits.double().log_softmax(-1), q_logits.double().log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).reshape(-1)  # per position


def _fmt(x: torch.Tensor) -> str:
    return f"{x.mean().item():.3e} ± {(x.std() / x.numel() ** 0.5).item():.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = bundled_model_dir()
    plain = load_model(path)
    g = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, plain.config.vocab_size, (args.prompts, args.prompt_len), generator=g)
    with torch.no_grad():
        ref = plain(ids, path=AttnPath.NAIVE).logits
        rows = []
        for scheme in EMULATED:
            cfg = load_explicit(
                json.dumps({"targets": {"re:.*kv_b_proj": scheme}}), scheme_names(), online=True
            )
            model = load_model(path, quantization_config=cfg)
            on = model(ids, path=AttnPath.NAIVE).logits
            for mine, base in zip(model.model.layers, plain.model.layers, strict=True):  # activations off
                w = base.self_attn.kv_b_proj.weight
                mine.self_attn.kv_b_online, _ = online_kv_b(w, scheme, torch.bfloat16, act=Act.NONE)
            off = model(ids, path=AttnPath.NAIVE).logits
            rows.append(
                (scheme, _fmt(_kl(ref, on)), _fmt(_kl(ref, off)), _fmt(_kl(off, on)), torch.equal(on, off))
            )
    n = args.prompts * args.prompt_len
    print(f"n = {n} positions ({args.prompts} prompts x {args.prompt_len}), seed {args.seed}")
    print(
        "| scheme | KL(bf16 || online, activations quantized) | KL(bf16 || online, activations bf16) | KL(off || on) | identical |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {'yes' if r[4] else 'no'} |")


if __name__ == "__main__":
    main()
