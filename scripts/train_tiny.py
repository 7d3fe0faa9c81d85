"""Train mlaq-tiny (DeepSeek-V3 architecture + MTP) on Python stdlib source; CPU, reproducible from a seed.

    .venv/bin/python scripts/train_tiny.py --out src/mlaq/assets/mlaq-tiny --run-dir build/tiny-runs

Trains scripts/tiny_lean.py's module (transformers' DeepSeek-V3 math, fewer and larger ops) with bf16
autocast matmuls and fp32 master weights, compiled with torch.compile. A usable checkpoint is exported
every --save-every-min minutes and at the end; run scripts/tiny_eval.py afterwards (it evaluates through
transformers' own implementation) and scripts/tiny_card.py for the model card.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tiny_data import (
    HELDOUT,
    document,
    encode_stream,
    split_corpus,
    stdlib_dir,
    tokenizer_config,
    train_tokenizer,
)
from tiny_export import export
from tiny_lean import LeanTiny
from tiny_model import TinyGeometry, build_config
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=None, help="text directory (default: this Python's stdlib)")
    p.add_argument("--suffix", default=".py", help="file suffix to read from the corpus")
    p.add_argument("--no-tests", action="store_true", help="leave out the corpus's test/ directory")
    p.add_argument("--heldout", default=",".join(HELDOUT), help="comma-separated top-level names held out")
    p.add_argument(
        "--max-files", type=int, default=0, help="use only the first N training files (smoke runs)"
    )
    p.add_argument("--out", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny")
    p.add_argument("--run-dir", type=Path, default=Path("build/tiny-runs"))
    p.add_argument("--vocab", type=int, default=6144)
    p.add_argument("--seq", type=int, default=2048, help="training context (tokens per window)")
    p.add_argument("--batch", type=int, default=4, help="windows per step")
    p.add_argument("--steps", type=int, default=480, help="total steps (an upper bound with a time budget)")
    p.add_argument("--decay-start", type=int, default=None, help="step where LR decay begins (default 80 %%)")
    p.add_argument("--time-budget-min", type=float, default=0.0, help="choose the decay start from wall time")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss (DeepSeek-V3: 0.3)")
    p.add_argument(
        "--bias-speed",
        type=float,
        default=1e-2,
        help="gamma of the aux-loss-free bias update (DeepSeek-V3: 1e-3 over far more steps)",
    )
    p.add_argument("--balance-alpha", type=float, default=0.01, help="sequence-wise balance loss weight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-compile", action="store_true", help="eager mode (slower; for debugging)")
    p.add_argument("--save-every-min", type=float, default=5.0)
    p.add_argument(
        "--init-from", type=Path, default=None, help="continue from an exported checkpoint (+ its tokenizer)"
    )
    p.add_argument(
        "--repeat-frac", type=float, default=0.0, help="share of windows that repeat a segment (copy task)"
    )
    p.add_argument("--repeat-min", type=int, default=0, help="shortest repeated segment (0: seq/8)")
    p.add_argument("--repeat-max", type=int, default=0, help="longest repeated segment (0: seq/2)")
    p.add_argument("--tiny-geometry", action="store_true", help="a very small model, for smoke tests only")
    return p.parse_args(argv)


def lr_at(step: int, a: argparse.Namespace) -> float:
    """Warmup-stable-decay: linear warmup, constant, then linear decay to min_lr_ratio * lr at the last step."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.decay_start is None or step < a.decay_start:
        return a.lr
    frac = (step - a.decay_start) / max(1, a.steps - a.decay_start)
    return a.lr * (1 - (1 - a.min_lr_ratio) * frac)


def plan_decay(step: int, elapsed_min: float, a: argparse.Namespace) -> None:
    """With --time-budget-min: once 82 % of the budget is spent, start an 18 %-of-steps-so-far decay.

    The chosen --steps/--decay-start are recorded; passing them back reproduces the run exactly.
    """
    if a.decay_start is None and a.time_budget_min and elapsed_min >= 0.82 * a.time_budget_min:
        a.decay_start = step
        a.steps = min(a.steps, step + max(10, int(0.18 * step)))
    elif a.decay_start is None and (not a.time_budget_min or step >= int(0.8 * a.steps)):
        a.decay_start = int(0.8 * a.steps)


@torch.no_grad()
def update_router_bias(model: LeanTiny, gamma: float) -> float:
    """DeepSeek-V3's auxiliary-loss-free balancing (section 2.1.2): after each step every router's
    e_score_correction_bias moves by gamma * sign(mean load - expert load). Returns the worst max/mean load."""
    worst = 0.0
    for moe in model.moe_layers():
        load = moe.stats[0].float()
        moe.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
        worst = max(worst, float(load.max() / load.mean()))
    return worst


def count_params(model: LeanTiny) -> dict[str, int]:
    """Parameter counts: total, main model, MTP layer, embeddings + lm_head."""
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.model.layers[model.n].parameters())
    emb = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    return {"total": total, "main": total - mtp, "mtp": mtp, "embeddings_and_lm_head": emb}


def make_optimizer(model: LeanTiny, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D) as usual."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def prepare(a: argparse.Namespace):
    """Corpus split, tokenizer, token streams, heldout text."""
    root = a.corpus or stdlib_dir()
    heldout = tuple(s for s in a.heldout.split(",") if s)
    train_files, held_files = split_corpus(root, a.suffix, heldout, tests=not a.no_tests)
    if a.max_files:
        train_files = train_files[: a.max_files]
    train_texts = [document(root, p) for p in train_files]
    held_text = "".join(document(root, p) for p in held_files)
    t0 = time.time()
    tok = (
        Tokenizer.from_file(str(a.init_from / "tokenizer.json"))
        if a.init_from
        else train_tokenizer(train_texts, a.vocab)
    )
    stream = encode_stream(tok, train_texts)
    info = {
        "corpus_root": str(root),
        "train_files": len(train_files),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "train_tokens": int(stream.size),
        "heldout_names": list(heldout),
        "heldout_files": [p.relative_to(root).as_posix() for p in held_files],
        "heldout_bytes": len(held_text.encode()),
        "tokenizer_seconds": round(time.time() - t0, 1),
    }
    return tok, stream, held_text, info


def make_window(stream: np.ndarray, rng: np.random.Generator, a: argparse.Namespace) -> np.ndarray:
    """seq + 1 tokens from a uniform start; with --repeat-frac, some windows instead cycle one natural
    segment of --repeat-min..--repeat-max tokens (default seq/8..seq/2; a copy task that makes induction
    heads form sooner)."""
    s = int(rng.integers(0, stream.size - a.seq - 1))
    if a.repeat_frac and rng.random() < a.repeat_frac:
        k = int(rng.integers(a.repeat_min or a.seq // 8, (a.repeat_max or a.seq // 2) + 1))
        return np.resize(stream[s : s + k], a.seq + 1)  # segment, segment, ... cut to seq + 1
    return stream[s : s + a.seq + 1]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tok, stream, held_text, info = prepare(a)
    print(json.dumps(info)[:2000], flush=True)
    geo = TinyGeometry(vocab_size=tok.get_vocab_size(), max_position_embeddings=max(2048, a.seq))
    if a.tiny_geometry:
        geo = TinyGeometry(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                           moe_intermediate_size=32, max_position_embeddings=max(2048, a.seq))  # fmt: skip
    cfg = build_config(geo, bos_token_id=tok.token_to_id("<|bos|>"), eos_token_id=tok.token_to_id("<|eos|>"))
    model = LeanTiny(cfg.to_dict()).train()
    if a.init_from:
        model.load_checkpoint_tensors(
            {k: v.float() for k, v in load_file(a.init_from / "model.safetensors").items()}
        )
    for moe in model.moe_layers():
        moe.balance_alpha = a.balance_alpha
    print(json.dumps(count_params(model)), flush=True)
    step_fn = model if a.no_compile else torch.compile(model)
    opt = make_optimizer(model, a.lr)
    rng = np.random.default_rng(a.seed)  # data order depends on the seed only
    tok_cfg = tokenizer_config(max(2048, a.seq))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "heldout.txt").write_text(held_text)
    history, last_save, t_train = [], time.time(), time.time()
    step = 0
    while step < a.steps:
        plan_decay(step, (time.time() - t_train) / 60, a)
        windows = [make_window(stream, rng, a) for _ in range(a.batch)]
        batch = torch.from_numpy(np.stack(windows).astype(np.int64))  # (B, seq + 1)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, _, main_ce, mtp_ce = step_fn(batch)  # batch: (B, seq + 1)
        bal = sum(moe.stats[1] for moe in model.moe_layers())
        loss = main_ce + a.mtp_weight * mtp_ce + bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
        opt.step()
        load = update_router_bias(model, a.bias_speed)
        elapsed = time.time() - t_train
        rec = {"step": step + 1, "main": round(main_ce.item(), 4), "mtp": round(mtp_ce.item(), 4),
               "lr": round(lr_at(step, a), 6), "gnorm": round(gnorm, 3), "bal": round(bal.item(), 4), "max_load": round(load, 2),
               "tok_s": round((step + 1) * a.batch * a.seq / elapsed), "min": round(elapsed / 60, 1)}  # fmt: skip
        history.append(rec)
        print(json.dumps(rec), flush=True)
        if time.time() - last_save > a.save_every_min * 60 or step + 1 == a.steps:
            export(model.checkpoint_tensors(), cfg, tok, tok_cfg, a.out)
            last_save = time.time()
            run = {**info, "args": {k: str(v) for k, v in vars(a).items()}, "argv": sys.argv,
                   "params": count_params(model), "steps_done": step + 1, "history": history,
                   "train_minutes": round(elapsed / 60, 1), "total_minutes": round((time.time() - t_start) / 60, 1),
                   "python": platform.python_version(), "torch": torch.__version__}  # fmt: skip
            (a.run_dir / "run_info.json").write_text(json.dumps(run, indent=1))
            print(f"saved checkpoint at step {step + 1}", flush=True)
        step += 1


if __name__ == "__main__":
    main()
