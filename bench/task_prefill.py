"""What one long-context task sample costs: the prefill of its context, and each scheme's decode of the
query and answer from that cache (what ``mlaq validate``'s task suite runs per sample; the prefill is
shared by every scheme under decode_only), in process CPU seconds. Two prefills: the whole model's
(``prefill``, with the last position's logits) and the cache-only one the suite runs (``prefill_cache``:
the last layer writes its latent entries and skips the rest).

    python bench/task_prefill.py [MODEL] [--lengths 512,1024,2048,4096] [--tail 16] [--threads 1]

Random token ids (the cost does not depend on them). Not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from mlaq.bundled import bundled_model_dir
from mlaq.model import ModelCache, load_model
from mlaq.settings import Settings
from mlaq.validate.defaults import DEFAULT_SCHEMES


def best(fn, *args, reps: int = 2) -> float:
    out = float("inf")
    for _ in range(reps):
        c0 = time.process_time()
        fn(*args)
        out = min(out, time.process_time() - c0)
    return out


def prefill(model, head: torch.Tensor, cache: ModelCache) -> None:
    cache.truncate(0)
    model.prefill(head, cache, logits_index=torch.zeros(1, dtype=torch.long))


def prefill_cache(model, head: torch.Tensor, cache: ModelCache) -> None:
    cache.truncate(0)
    model.prefill_cache(head, cache)


def decode(model, tail: torch.Tensor, cache: ModelCache, keep: int) -> None:
    model.decode(tail, cache)
    cache.truncate(keep)


def prepare(model, scheme: str) -> None:
    for layer in model.model.layers:
        layer.self_attn.prepare(scheme)


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--tail", type=int, default=16, help="query + answer tokens decoded per scheme")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = load_model(a.model or bundled_model_dir(), dtype=torch.bfloat16, settings=Settings())
    for layer in model.model.layers:
        layer.self_attn.prepare("bf16")
    print(f"{a.threads} thread(s), 1-min load {os.getloadavg()[0]:.1f}; CPU seconds, best of 2")
    for length in map(int, a.lengths.split(",")):
        ids = torch.randint(0, model.config.vocab_size, (1, length))
        keep = length - a.tail
        cache = ModelCache()
        line = f"{length:>6} tokens: prefill {best(prefill, model, ids[:, :keep], cache):.3f} s"
        line += f", cache only {best(prefill_cache, model, ids[:, :keep], cache):.3f} s"
        for scheme in ("bf16", *DEFAULT_SCHEMES):
            prep = best(prepare, model, scheme, reps=1)
            dec = best(decode, model, ids[:, keep:], cache, keep)
            line += f"; {scheme} decode {dec:.3f} (prepare {prep:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
