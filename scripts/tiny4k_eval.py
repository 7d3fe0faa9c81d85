"""Held-out figures of mlaq-tiny-4k for its model card, in bf16 through mlaq's engine (parity-tested
against transformers by tests/test_tiny_parity.py).

    python scripts/tiny4k_eval.py [--model src/mlaq/assets/mlaq-tiny-4k] [--samples 20] [--out FILE]

On two held-out haystacks of different kinds (heldout.txt: Python source of stdlib modules never trained
on; heldout-prose.txt: the Python tutorial and FAQ, English prose from a source never trained on):
1. loss by position on plain text (windows of the full context), the "uses its context" curve;
2. the task suite of `mlaq validate --tasks` (mlaq.validate.tasks: fresh keys, values and templates)
   scored on the bf16 decode path: needle by depth, multikey with 16 pairs, copy of a 256-token
   segment placed in the first quarter (>= 2K tokens before the query at 4096), vartrack;
   accuracy with Wilson 95 % intervals and the copy task's token accuracy.
Prints one JSON object (also written to --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from mlaq.model import ModelCache, load_model
from mlaq.settings import Settings
from mlaq.validate.intervals import wilson
from mlaq.validate.tasks.generators import make_sample
from mlaq.validate.tasks.haystack import Haystack
from mlaq.validate.tasks.scoring import score_variants
from mlaq.validate.tasks.spec import TaskConfig

REPO = Path(__file__).resolve().parents[1]
EDGES = (0, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@torch.no_grad()
def loss_by_position(model, tokens: list[int], ctx: int, windows: int) -> dict[str, float]:
    starts = np.linspace(0, len(tokens) - ctx - 2, windows).astype(int)
    nll = []
    for s in starts:
        ids = torch.tensor([tokens[s : s + ctx + 1]])
        logits = model.prefill(ids[:, :-1], ModelCache()).logits.float()  # (1, ctx, V)
        lp = torch.log_softmax(logits, -1)[0]
        nll.append(-lp.gather(1, ids[0, 1:, None])[:, 0].numpy())
    mean = np.mean(nll, axis=0)
    return {f"{a}-{b}": round(float(mean[a:b].mean()), 4) for a, b in itertools.pairwise(EDGES) if a < ctx}


TASKS = {"needle": {}, "multikey": {"pairs": 16}, "copy": {"copy_tokens": 256}, "vartrack": {}}


def tasks(model, hay: Haystack, encode, lengths, samples: int, seed: int, names=tuple(TASKS)) -> dict:
    out: dict = {}
    for task, extra in ((t, TASKS[t]) for t in names):
        cfg = TaskConfig(
            tasks=(task,), lengths=lengths, samples=samples, seed=seed, batch_tokens=8192, **extra
        )
        ss = [make_sample(task, n, i, cfg, hay, encode) for n in lengths for i in range(samples)]
        sc = score_variants(ss, ["bf16"], lambda v: model, lambda v: v, batch_tokens=cfg.batch_tokens)["bf16"]
        per_len: dict = {}
        for n in lengths:
            rows = [(s, c) for s, c in zip(ss, sc, strict=True) if s.length == n]
            k = sum(c.correct for _, c in rows)
            lo, hi = wilson(k, len(rows))
            entry = {"accuracy": k / len(rows), "ci": [lo, hi], "n": len(rows),
                     "token_accuracy": float(np.mean([c.token_accuracy for _, c in rows])),
                     "logprob": float(np.mean([c.logprob for _, c in rows]))}  # fmt: skip
            if task == "needle":
                entry["by_depth"] = {
                    f"{d:g}": float(np.mean([c.correct for s, c in rows if s.depth == d]))
                    for d in sorted({s.depth for s, _ in rows})
                }
            if task == "copy":
                entry["distance"] = int(np.min([s.query_start - s.fact_start for s, _ in rows]))
            per_len[str(n)] = entry
        out[task] = per_len
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=REPO / "src/mlaq/assets/mlaq-tiny-4k")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--haystacks", default="code,prose", help="code (heldout.txt), prose (heldout-prose.txt)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    model = load_model(a.model, dtype=torch.bfloat16, settings=Settings())
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    lengths = tuple(int(x) for x in a.lengths.split(","))
    names = tuple(a.tasks.split(","))
    if unknown := [t for t in names if t not in TASKS]:
        raise SystemExit(f"--tasks: unknown {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    ctx = json.loads((a.model / "config.json").read_text())["max_position_embeddings"]
    result: dict = {"model": str(a.model), "samples": a.samples, "lengths": list(lengths), "tasks": list(names),
                    "seed": a.seed, "threads": a.threads}  # fmt: skip
    files = {"code": "heldout.txt", "prose": "heldout-prose.txt"}
    for name, file in ((h, files[h]) for h in a.haystacks.split(",")):
        ids = encode((a.model / file).read_text())
        result[name] = {
            "haystack": file,
            "tokens": len(ids),
            "loss_by_position": loss_by_position(model, ids, ctx, a.windows) if a.windows else {},
            "tasks": tasks(model, Haystack(file, tuple(ids)), encode, lengths, a.samples, a.seed, names),
        }
        print(json.dumps({name: result[name]}), flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
