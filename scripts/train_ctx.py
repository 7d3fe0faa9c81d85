"""Train mlaq-tiny-4k: DeepSeek-V3's real MLA geometry, 4K context, retrieval-dense curriculum; resumable.

    python scripts/train_ctx.py                      # start or resume the run in ~/.cache/mlaq-train/RUN
    python scripts/train_ctx.py --export-only        # write the current weights to --out

A length curriculum (--phases SEQxBATCH:TOKENS,...) runs most tokens short and a short phase at 4096.
Windows mix natural code and prose with embedded retrieval tasks (scripts/ctx_data.py). The module is
scripts/tiny_lean.py's (transformers' DeepSeek-V3 math; parity-tested), bf16 autocast, torch.compile.

Resuming: every --save-every-min minutes the whole state (fp32 weights, AdamW moments, step, tokens,
wall time) is written atomically as one safetensors file under --run-dir; the data of step s depends
only on (seed, s), so a resumed run sees exactly the batches an uninterrupted one would. At each phase
boundary the state is also copied (bf16, one file replaced) to --commit-state (default
~/.cache/mlaq-train/mlaq-tiny-4k.safetensors). Run 1's end state is not in the tree; it is kept in git
history: `git show 9e0406c94222a5190dd0e9ffc819e267505d1564:scripts/state/mlaq-tiny-4k.safetensors > FILE`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch
from ctx_data import KERNEL_DOCS, MIXES, PY_DOCS, code_texts, heldout_prose, make_window, prose_texts
from ctx_plan import context, lr_at, phase_at, phases
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_data import SPECIAL, encode_stream, tokenizer_config, train_tokenizer
from tiny_export import export
from tiny_lean import LeanTiny
from tiny_model import TinyGeometry, build_config
from tokenizers import Tokenizer
from train_tiny import make_optimizer, update_router_bias

from mlaq.model.layers.linear import onednn_bf16_gemm

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mlaq-train"
GEOMETRY = TinyGeometry(
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, q_lora_rank=128,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=768,
    moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
    max_position_embeddings=4096,
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", default="tiny4k-v1", help="run name (state under --run-dir)")
    p.add_argument("--run-dir", type=Path, default=None, help=f"default {CACHE}/RUN")
    p.add_argument("--out", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--commit-state", type=Path, default=CACHE / "mlaq-tiny-4k.safetensors")
    p.add_argument("--phases", default="512x8:3000000,1024x4:1400000,2048x2:900000,4096x1:500000")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--decay-tokens", type=int, default=400000, help="last N tokens decay LR linearly to 10 %%"
    )
    p.add_argument("--mtp-weight", type=float, default=0.3)
    p.add_argument(
        "--answer-weight", type=float, default=4.0, help="loss weight of tokens only the context gives"
    )
    p.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="default",
        help="task mix of the windows (scripts/ctx_data.py): dense = ~2x the key -> value answers per token; "
        "long: 8K-16K windows, more facts; needle: long, needle-heavy, some windows opening with a fact; "
        "far: needle-heavy, half the kv windows with their facts in the first quarter",
    )
    p.add_argument("--init-from", type=Path, default=None,
                   help="a state file (weights + AdamW moments) or an exported model directory (weights "
                        "only) to start a NEW run from (step and LR schedule start again); its tokens are "
                        "carried into the totals")  # fmt: skip
    p.add_argument("--yarn-factor", type=float, default=0.0,
                   help="extend the context by this factor with DeepSeek-V3's YaRN (rope_scaling type yarn): "
                        "max_position_embeddings = factor x the original context (4096, or --init-from's)")  # fmt: skip
    p.add_argument("--train-past-context", action="store_true",
                   help="let --phases run past the context: positions past max_position_embeddings get the "
                        "same RoPE / YaRN frequencies, continued, so the context's longest distances are not "
                        "the longest trained; the exported config keeps the context")  # fmt: skip
    p.add_argument("--bias-speed", type=float, default=1e-2)
    p.add_argument("--balance-alpha", type=float, default=0.01)
    p.add_argument("--prose-mb", type=float, default=30.0, help="MB of kernel docs to train on")
    p.add_argument("--prose-dir", type=Path, default=KERNEL_DOCS, help="training prose (*.rst[.gz])")
    p.add_argument("--heldout-prose-dir", type=Path, default=PY_DOCS, help="has tutorial/ and faq/ *.rst.txt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1: one core to itself beats two contended ones")
    p.add_argument("--save-every-min", type=float, default=5.0)
    p.add_argument("--export-every-min", type=float, default=30.0)
    p.add_argument("--max-minutes", type=float, default=0.0, help="stop (after saving) after this long")
    p.add_argument("--export-only", action="store_true")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help="bf16 autocast for matmuls; auto: only where torch has a native bf16 GEMM (oneDNN with "
                        "AVX512_BF16 or AMX; mlaq.model.layers.linear): on an AVX2-only CPU the bf16 matmul runs "
                        "~100x slower than fp32")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny model, tiny corpus: for the CI test")
    return p.parse_args(argv)


def init_tokenizer(a: argparse.Namespace) -> Path:
    """The tokenizer of --init-from: an exported directory's, or a state file's run (its corpus/, else
    --out's export); SystemExit when there is none (a new tokenizer would not match the weights)."""
    src = a.init_from
    places = [src / "tokenizer.json"] if src.is_dir() else [src.parent / "corpus" / "tokenizer.json"]
    places.append(a.out / "tokenizer.json")
    for place in places:
        if place.exists():
            return place
    raise SystemExit(f"--init-from {src}: no tokenizer.json at {' or '.join(map(str, places))}; "
                     "pass the exported model directory (weights and tokenizer) instead")  # fmt: skip


def corpus(a: argparse.Namespace, run_dir: Path) -> tuple[Tokenizer, list[np.ndarray], str, str, dict]:
    """Tokenizer and token streams, built once per run and cached (deterministic)."""
    cdir = run_dir / "corpus"
    code, held_code = code_texts()
    if a.smoke:
        code, held_code = code[:40], held_code[:20000]
    prose = prose_texts(int((0.3 if a.smoke else a.prose_mb) * 2**20), a.prose_dir)
    held_prose = heldout_prose(a.heldout_prose_dir)
    if not (cdir / "tokenizer.json").exists():
        cdir.mkdir(parents=True, exist_ok=True)
        if a.init_from is not None:  # continuing a model: its tokenizer, never a new one
            tok = Tokenizer.from_file(str(init_tokenizer(a)))
        else:
            rng = np.random.default_rng(a.seed)  # tokenizer from a sample of both kinds
            sample = [code[i] for i in rng.permutation(len(code))[:600]] + prose[:: max(1, len(prose) // 600)]
            tok = train_tokenizer(sample, 512 if a.smoke else GEOMETRY.vocab_size)
        for name, texts in (("code", code), ("prose", prose)):
            np.save(cdir / f"{name}.npy", encode_stream(tok, texts))
        tok.save(str(cdir / "tokenizer.json"))
    tok = Tokenizer.from_file(str(cdir / "tokenizer.json"))
    streams = [np.load(cdir / f"{n}.npy").astype(np.int64) for n in ("code", "prose")]
    info = {"train_tokens": {n: int(s.size) for n, s in zip(("code", "prose"), streams, strict=True)},
            "code_files": len(code), "prose_files": len(prose)}  # fmt: skip
    return tok, streams, held_code, held_prose, info


def save_state(path: Path, model: LeanTiny, opt: torch.optim.AdamW, meta: dict, dtype: torch.dtype) -> None:
    """Weights, router biases and AdamW moments in one safetensors file, written atomically."""
    tensors = {f"model.{k}": v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        st = opt.state.get(p)
        if st:
            tensors[f"opt.{i}.exp_avg"] = st["exp_avg"].to(dtype).contiguous()
            tensors[f"opt.{i}.exp_avg_sq"] = st["exp_avg_sq"].to(dtype).contiguous()
            meta.setdefault("opt_steps", {})[str(i)] = float(st["step"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)


def load_state(path: Path, model: LeanTiny, opt: torch.optim.AdamW) -> dict:
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["meta"])
        state = model.state_dict()
        with torch.no_grad():
            for k, v in state.items():
                v.copy_(f.get_tensor(f"model.{k}").to(v.dtype))
        for i, p in enumerate(model.parameters()):
            if f"opt.{i}.exp_avg" in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
                opt.state[p] = {
                    "step": torch.tensor(meta["opt_steps"][str(i)]),
                    "exp_avg": f.get_tensor(f"opt.{i}.exp_avg").float(),
                    "exp_avg_sq": f.get_tensor(f"opt.{i}.exp_avg_sq").float(),
                }
    return meta


def load_model_dir(path: Path, model: LeanTiny) -> dict:
    """Weights of an exported model directory (model.safetensors, training.json): a new run from them starts
    with fresh AdamW moments (the warmup re-estimates them)."""
    tensors = load_file(str(path / "model.safetensors"))
    model.load_checkpoint_tensors({k: v.float() for k, v in tensors.items()})
    return json.loads((path / "training.json").read_text())


@torch.no_grad()
def answer_stats(
    logits: torch.Tensor, targets: torch.Tensor, flags: torch.Tensor
) -> tuple[float | None, float | None]:
    """Mean CE and top-1 accuracy on the answer tokens only (what retrieval is): the number to watch."""
    sel = flags.bool()
    if not sel.any():
        return None, None
    rows, want = logits[sel].float(), targets[sel]
    ce = torch.nn.functional.cross_entropy(rows, want)
    return round(float(ce), 4), round(float((rows.argmax(-1) == want).float().mean()), 4)


def do_export(model, cfg, tok, a, held_code: str, held_prose: str, meta: dict) -> None:
    export(model.checkpoint_tensors(), cfg, tok, tokenizer_config(cfg.max_position_embeddings), a.out)
    (a.out / "heldout.txt").write_text(held_code)
    (a.out / "heldout-prose.txt").write_text(held_prose)
    (a.out / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"exported to {a.out} at {meta['tokens']} tokens", flush=True)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    run_dir = a.run_dir or CACHE / a.run
    plan, geo = phases(a.phases), GEOMETRY
    longest = max(seq for seq, _, _ in plan)
    if a.smoke:  # its context: the longest phase (the shortest with --train-past-context)
        ctx = min(seq for seq, _, _ in plan) if a.train_past_context else longest
        geo = TinyGeometry(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                           v_head_dim=32, intermediate_size=128, moe_intermediate_size=32,
                           max_position_embeddings=ctx)  # fmt: skip
        if a.yarn_factor:
            geo = TinyGeometry(**{**geo.__dict__, "max_position_embeddings": int(geo.max_position_embeddings
                                                                                 // a.yarn_factor)})  # fmt: skip
    geo, rope_params = context(a, geo, plan)
    tok, streams, held_code, held_prose, info = corpus(a, run_dir)
    bos, eos = tok.token_to_id(SPECIAL[0]), tok.token_to_id(SPECIAL[1])
    cfg = build_config(geo, bos_token_id=bos, eos_token_id=eos, rope_parameters=rope_params)
    torch.manual_seed(a.seed)
    model = LeanTiny(cfg.to_dict(), positions=longest).train()
    for moe in model.moe_layers():
        moe.balance_alpha = a.balance_alpha
    opt = make_optimizer(model, a.lr)
    state_path = run_dir / "state.safetensors"
    meta = {"step": 0, "tokens": 0, "train_seconds": 0.0, "history": []}
    for src in (state_path, a.commit_state):
        if src.exists() and (a.init_from is None or src == state_path):
            meta = load_state(src, model, opt)
            print(f"resumed from {src} at step {meta['step']}, {meta['tokens']} tokens", flush=True)
            break
    else:
        if a.init_from is not None:
            prior = (
                load_state(a.init_from, model, opt)
                if a.init_from.is_file()
                else load_model_dir(a.init_from, model)
            )
            meta["init_from"] = {"file": a.init_from.name, "tokens": prior["tokens"], "step": prior["step"],
                                 "train_seconds": prior["train_seconds"], "phases": prior.get("phases"),
                                 "prior": prior.get("init_from")}  # fmt: skip
            print(f"new run from {a.init_from} ({prior['tokens']} tokens before)", flush=True)
    meta.update(info=info, geometry=geo.__dict__, rope=rope_params, phases=a.phases, mix=a.mix, seed=a.seed, python=platform.python_version(),
                torch=torch.__version__, cpu=platform.processor() or platform.machine())  # fmt: skip
    if a.export_only:
        return do_export(model, cfg, tok, a, held_code, held_prose, meta)
    bf16 = a.autocast == "bf16" or (a.autocast == "auto" and onednn_bf16_gemm())
    meta["autocast"] = "bf16" if bf16 else "off (fp32)"
    print(f"matmuls in {'bf16 autocast' if bf16 else 'fp32'}", flush=True)
    step_fn = model if a.no_compile else torch.compile(model)
    total = sum(n for _, _, n in plan)
    t0, last_save, last_export = time.time(), time.time(), time.time()
    base_seconds, mix = meta["train_seconds"], MIXES[a.mix]
    while (ph := phase_at(meta["tokens"], plan)) < len(plan):
        seq, batch, _ = plan[ph]
        rng = np.random.default_rng([a.seed, meta["step"]])  # batch of step s depends on (seed, s) only
        windows = [make_window(streams, seq, tok, rng, mix) for _ in range(batch)]
        x = torch.from_numpy(np.stack([w for w, _ in windows]))  # (B, seq + 1)
        flags = torch.from_numpy(np.stack([m for _, m in windows]))[:, 1:]  # targets' answer flags
        weights = 1.0 + (a.answer_weight - 1.0) * flags.float()
        lr = lr_at(meta["step"], meta["tokens"], total, a)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, _, main_ce, mtp_ce = step_fn(x, weights)
        ans_ce, ans_acc = answer_stats(logits, x[:, 1:], flags)
        bal = sum(moe.stats[1] for moe in model.moe_layers())
        loss = main_ce + a.mtp_weight * mtp_ce + bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        load = update_router_bias(model, a.bias_speed)
        meta["step"] += 1
        meta["tokens"] += batch * seq
        meta["train_seconds"] = base_seconds + time.time() - t0
        rec = {"step": meta["step"], "tokens": meta["tokens"], "seq": seq, "main": round(main_ce.item(), 4),
               "mtp": round(mtp_ce.item(), 4), "ans": ans_ce, "ans_acc": ans_acc, "lr": round(lr, 6), "gnorm": round(gnorm, 3),
               "max_load": round(load, 2), "min": round(meta["train_seconds"] / 60, 2)}  # fmt: skip
        if meta["step"] % 10 == 0:
            meta["history"].append(rec)
        print(json.dumps(rec), flush=True)
        done_phase = phase_at(meta["tokens"], plan) != ph
        stop = a.max_minutes and time.time() - t0 > a.max_minutes * 60
        if done_phase or stop or time.time() - last_save > a.save_every_min * 60:
            save_state(state_path, model, opt, meta, torch.float32)
            last_save = time.time()
        if done_phase:
            save_state(a.commit_state, model, opt, dict(meta), torch.bfloat16)
            print(f"phase {ph} ({seq}x{batch}) done; state copied to {a.commit_state}", flush=True)
        if done_phase or time.time() - last_export > a.export_every_min * 60:
            do_export(model, cfg, tok, a, held_code, held_prose, meta)
            last_export = time.time()
        if stop:
            print("stopping: --max-minutes reached (state saved; run again to resume)", flush=True)
            return None
    return None


if __name__ == "__main__":
    main()
