"""Evaluate mlaq-tiny on its held-out text: loss by context position, bits per byte, MTP acceptance.

    .venv/bin/python scripts/tiny_eval.py --model src/mlaq/assets/mlaq-tiny --json build/tiny-runs/eval.json

Everything is computed through transformers' own DeepSeek-V3 implementation (scripts/tiny_export.load_tiny),
not the training module; it also checks that the two give the same logits for the checkpoint's weights, and prints a few greedy completions of held-out prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tiny_export import load_tiny
from tokenizers import Tokenizer

REPO = Path(__file__).resolve().parents[1]
BUCKETS = ((0, 64), (64, 256), (256, 512), (512, 1024), (1024, 2048))
CONTEXTS = (0, 64, 256, 512, 1024, 1536)  # tokens of context before the scored block
SCORED = 512  # the block scored under every context length


def parity(model_dir: Path, ids: torch.Tensor) -> dict[str, float]:
    """Max |logit| difference, fp32: transformers (from_pretrained + its decoder layer as the MTP layer)
    vs the training module (scripts/tiny_lean.py) holding the checkpoint's weights."""
    from safetensors.torch import load_file
    from tiny_lean import LeanTiny

    loaded = load_tiny(model_dir)
    lean = LeanTiny(json.loads((model_dir / "config.json").read_text())).eval()
    lean.load_checkpoint_tensors(
        {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()}
    )
    with torch.no_grad():
        a = loaded(ids)
        b = lean(ids)
    return {
        "main_logits_max_abs_diff": float((a[0] - b[0]).abs().max()),
        "mtp_logits_max_abs_diff": float((a[1] - b[1]).abs().max()),
        "logit_scale": float(a[0].abs().max()),
    }


@torch.no_grad()
def heldout_metrics(model, tok: Tokenizer, ids: list[int], seq: int, max_windows: int) -> dict:
    """Teacher-forced main/MTP loss by position, bits per byte, MTP k=1 greedy acceptance."""
    from tiny_model import moe_gates

    gates = moe_gates(model)
    loads = [torch.zeros(g.num_experts) for g in gates]

    def count(i: int):
        def hook(module: torch.nn.Module, args: tuple, out: tuple) -> None:  # returns None: output unchanged
            loads[i] += torch.bincount(out[2].flatten(), minlength=module.num_experts)

        return hook

    hooks = [g.register_forward_hook(count(i)) for i, g in enumerate(gates)]
    byte_len = torch.tensor([len(tok.id_to_token(i)) for i in range(tok.get_vocab_size())])  # 1 char = 1 byte
    nll_sum = torch.zeros(seq, dtype=torch.float64)
    cnt = torch.zeros(seq, dtype=torch.float64)
    acc_sum = torch.zeros(seq, dtype=torch.float64)
    mtp_nll_sum, mtp_top1, main_top1, bytes_total, windows = 0.0, 0.0, 0.0, 0, 0
    for start in range(0, len(ids) - 1, seq):
        chunk = torch.tensor(ids[start : start + seq + 1]).unsqueeze(0)  # (1, <= seq + 1)
        if chunk.shape[1] < 3 or (max_windows and windows >= max_windows):
            break
        logits, mlog, _, _ = model(chunk)  # (1, T, V), (1, T - 1, V)
        t = logits.shape[1]
        nll = F.cross_entropy(logits[0].float(), chunk[0, 1:], reduction="none").double()
        nll_sum[:t] += nll
        cnt[:t] += 1
        bytes_total += int(byte_len[chunk[0, 1:]].sum())
        greedy = logits[0].argmax(-1)  # greedy[t] = main prediction of x_{t+1}
        main_top1 += float((greedy == chunk[0, 1:]).sum())
        draft = mlog[0].argmax(-1)  # draft[t] = MTP prediction of x_{t+2} given true x_{t+1}
        acc = (draft == greedy[1:]).double()  # accepted iff the target's greedy token at t+1 agrees
        acc_sum[: t - 1] += acc
        mtp_nll_sum += float(F.cross_entropy(mlog[0].float(), chunk[0, 2:], reduction="sum"))
        mtp_top1 += float((draft == chunk[0, 2:]).sum())
        windows += 1
    for h in hooks:
        h.remove()
    n_tok, n_mtp = float(cnt.sum()), float(cnt[1:].sum())
    by_pos = {}
    for lo, hi in BUCKETS:
        c = float(cnt[lo:hi].sum())
        if c:
            by_pos[f"{lo}-{hi}"] = {
                "loss": float(nll_sum[lo:hi].sum()) / c,
                "mtp_acceptance": float(acc_sum[lo:hi].sum()) / max(1.0, float(cnt[lo + 1 : hi + 1].sum())),
                "tokens": int(c),
            }
    return {
        "windows": windows,
        "tokens": int(n_tok),
        "bytes": bytes_total,
        "loss": float(nll_sum.sum()) / n_tok,
        "bits_per_byte": float(nll_sum.sum()) / math.log(2) / bytes_total,
        "main_top1": main_top1 / n_tok,
        "mtp_loss": mtp_nll_sum / n_mtp,
        "mtp_top1": mtp_top1 / n_mtp,
        "mtp_acceptance": float(acc_sum.sum()) / n_mtp,
        "by_position": by_pos,
        # share of routed slots per expert, per MoE layer (main layers 1.., then the MTP layer)
        "expert_load": [[round(float(x), 4) for x in c / c.sum()] for c in loads],
    }


@torch.no_grad()
def context_curve(model, ids: list[int], seq: int, windows: int) -> list[dict]:
    """Same tokens, more context: the last SCORED tokens of `windows` full windows (spread evenly over
    the text), scored when the model sees only c tokens before the block, for c in CONTEXTS. Unlike loss
    by position in the window (where content changes along with position), every row here scores the
    same tokens, so a fall with c is the model using longer context."""
    starts = list(range(0, len(ids) - seq - 1, seq))
    step = max(1, len(starts) // windows) if windows else 1
    starts = starts[::step][: windows or None]
    rows = []
    for c in CONTEXTS:
        nll, acc, n, n_acc = 0.0, 0.0, 0, 0
        for start in starts:
            end = start + seq  # predicted tokens: ids[end - SCORED + 1 .. end]
            chunk = torch.tensor(ids[end - SCORED - c : end + 1]).unsqueeze(0)  # (1, c + SCORED + 1)
            logits, mlog, _, _ = model(chunk)  # (1, c + SCORED, V), (1, c + SCORED - 1, V)
            nll += float(F.cross_entropy(logits[0, c:].float(), chunk[0, c + 1 :], reduction="sum"))
            greedy, draft = logits[0].argmax(-1), mlog[0].argmax(-1)
            acc += float((draft[c:] == greedy[c + 1 :]).sum())
            n, n_acc = n + SCORED, n_acc + SCORED - 1
        rows.append({"context": c, "loss": nll / n, "mtp_acceptance": acc / n_acc, "tokens": n})
    return rows


@torch.no_grad()
def copy_test(
    model, ids: list[int], segment: int = 128, gaps: tuple[int, ...] = (0, 256, 768, 1536)
) -> list[dict]:
    """In-context copying: a held-out segment A, then `gap` tokens of other held-out text, then A again.
    A model that uses its context predicts the second A far better than the first (induction)."""
    offsets = [len(ids) * (2 * k + 1) // 16 for k in range(6)]
    rows = []
    for gap in gaps:
        first = second = 0.0
        for off in offsets:
            a = ids[off : off + segment]
            filler = ids[off + 4 * segment : off + 4 * segment + gap]
            x = torch.tensor(a + filler + a).unsqueeze(0)  # (1, 2 * segment + gap)
            nll = F.cross_entropy(model(x)[0][0].float(), x[0, 1:], reduction="none")
            first += float(nll[: segment - 1].mean())
            second += float(nll[segment + gap :].mean())
        rows.append({"gap": gap, "first": first / len(offsets), "second": second / len(offsets)})
    return rows


@torch.no_grad()
def samples(model, tok: Tokenizer, ids: list[int], offsets: list[int], prompt: int, new: int) -> list[dict]:
    """Greedy completions (transformers generate with its KV cache) of held-out prompts."""
    out = []
    for off in offsets:
        p = torch.tensor(ids[off : off + prompt]).unsqueeze(0)
        gen = model.lm.generate(
            p, max_new_tokens=new, do_sample=False, pad_token_id=tok.token_to_id("<|pad|>")
        )
        out.append(
            {
                "offset": off,
                "prompt_tail": tok.decode(ids[off + prompt - 40 : off + prompt]),
                "completion": tok.decode(gen[0, prompt:].tolist()),
                "truth": tok.decode(ids[off + prompt : off + prompt + new]),
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny")
    p.add_argument("--text", type=Path, default=None, help="evaluation text (default: MODEL/heldout.txt)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--max-windows", type=int, default=0, help="0 = the whole text")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--curve-windows", type=int, default=24, help="windows for the context curve (0 = all)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    t0 = time.time()
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    text = (a.text or a.model / "heldout.txt").read_text()
    ids = tok.encode(text, add_special_tokens=False).ids
    model = load_tiny(a.model)
    res = {
        "text_bytes": len(text.encode()),
        "text_tokens": len(ids),
        "parity": parity(a.model, torch.tensor(ids[:512]).unsqueeze(0)),
        "heldout": heldout_metrics(model, tok, ids, a.seq, a.max_windows),
        "context_curve": context_curve(model, ids, a.seq, a.curve_windows),
        "copy_test": copy_test(model, ids),
        "samples": samples(model, tok, ids, [len(ids) // 7, len(ids) // 2, (5 * len(ids)) // 6], 256, 48),
        "params": sum(q.numel() for q in model.parameters()),
        "eval_seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
