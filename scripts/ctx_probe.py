"""Quick probes of a mlaq-tiny-4k training state on held-out text (for watching a run, not the model card).

    python scripts/ctx_probe.py [--state ~/.cache/mlaq-train/tiny4k-v1/state.safetensors] [--n 16]

Prints held-out loss by position (code and prose), needle / 16-key retrieval and copy accuracy
(teacher-forced argmax of every answer token) at several lengths. Fresh keys (seed 12345), held-out
haystacks; the model card uses the task suite of `mlaq validate` instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from ctx_data import FORMS, heldout_prose, random_key, random_value
from safetensors import safe_open
from tiny_lean import LeanTiny
from tiny_model import build_config
from tokenizers import Tokenizer
from train_ctx import CACHE, GEOMETRY, code_texts


def load(state: Path, tok: Tokenizer) -> LeanTiny:
    cfg = build_config(GEOMETRY, bos_token_id=0, eos_token_id=1)
    model = LeanTiny(cfg.to_dict()).eval()
    with safe_open(str(state), "pt") as f, torch.no_grad():
        for k, v in model.state_dict().items():
            v.copy_(f.get_tensor(f"model.{k}").to(v.dtype))
    return model


@torch.no_grad()
def logits(model: LeanTiny, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model.lm_head(model.hidden(x))[0].float()  # (T, V)


def loss_by_position(model, stream: np.ndarray, n: int, windows: int) -> dict[str, float]:
    edges = [0, 64, 256, 512, 1024, 2048, 4096]
    sums = np.zeros(len(edges) - 1)
    starts = np.linspace(0, stream.size - n - 2, windows).astype(int)
    for s in starts:
        ids = stream[s : s + n + 1].tolist()
        lp = torch.log_softmax(logits(model, ids[:-1]), -1)
        nll = -lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
        for i in range(len(edges) - 1):
            sums[i] += nll[edges[i] : edges[i + 1]].mean() if edges[i] < n else np.nan
    return {f"{edges[i]}-{edges[i + 1]}": round(sums[i] / windows, 3) for i in range(len(edges) - 1)}


def retrieval(model, tok, stream, n: int, pairs: int, samples: int, rng) -> float:
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    hits = 0
    for _ in range(samples):
        form = FORMS[rng.integers(len(FORMS))]
        keys = [random_key(rng) for _ in range(pairs)]
        vals = [random_value(rng) for _ in keys]
        facts = [enc("\n" + form[0].format(k=k, v=v) + "\n") for k, v in zip(keys, vals, strict=True)]
        q = int(rng.integers(pairs))
        prompt_q, answer = enc("\n" + form[1].format(k=keys[q])), enc(vals[q])
        budget = n - len(prompt_q) - len(answer) - sum(map(len, facts))
        s = int(rng.integers(0, stream.size - budget))
        hay = stream[s : s + budget].tolist()
        pos = sorted(rng.integers(0, budget, size=pairs).tolist())
        body, last = [], 0
        for p, f in zip(pos, facts, strict=True):
            body += hay[last:p] + f
            last = p
        ids = body + hay[last:] + prompt_q + answer
        pred = logits(model, ids[:-1])[-len(answer) :].argmax(-1).tolist()
        hits += pred == answer
    return hits / samples


def copy_acc(model, stream, n: int, seg: int, samples: int, rng) -> float:
    acc = []
    for _ in range(samples):
        s = int(rng.integers(0, stream.size - n))
        hay = stream[s : s + n].tolist()
        ids = hay[: n - seg] + hay[:seg]  # the first `seg` tokens again at the end (gap n - 2 seg)
        pred = logits(model, ids[:-1])[-seg + 1 :].argmax(-1).tolist()
        acc.append(np.mean(np.array(pred) == np.array(ids[-seg + 1 :])))
    return float(np.mean(acc))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--state", type=Path, default=CACHE / "tiny4k-v1" / "state.safetensors")
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--lengths", default="512,1024,2048,4096")
    a = p.parse_args()
    torch.set_num_threads(1)
    tok = Tokenizer.from_file(str(a.state.parent / "corpus" / "tokenizer.json"))
    model = load(a.state, tok)
    with safe_open(str(a.state), "pt") as f:
        meta = json.loads(f.metadata()["meta"])
    print(f"step {meta['step']}, {meta['tokens']} tokens, {meta['train_seconds'] / 60:.1f} min")
    enc = lambda t: np.array(tok.encode(t, add_special_tokens=False).ids)  # noqa: E731
    held = {"code": enc(code_texts()[1]), "prose": enc(heldout_prose())}
    lengths = [int(x) for x in a.lengths.split(",")]
    for name, stream in held.items():
        print(name, "loss by position", loss_by_position(model, stream, max(lengths), 4))
    rng = np.random.default_rng(12345)
    for n in lengths:
        row = {}
        for name, stream in held.items():
            row[f"needle_{name}"] = retrieval(model, tok, stream, n, 1, a.n, rng)
            row[f"kv16_{name}"] = retrieval(model, tok, stream, n, 16, a.n, rng)
            row[f"copy_{name}"] = round(
                copy_acc(model, stream, n, min(256, n // 4), max(2, a.n // 4), rng), 3
            )
        print(n, json.dumps(row))


if __name__ == "__main__":
    main()
