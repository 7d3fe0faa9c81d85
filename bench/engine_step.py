"""The engine's own cost of a decode step, measured with a model that does no work: what is left of a
batch-1 budget (80 % of ``bench/roofline.py``'s floor) once the engine around the model has run.

    python bench/engine_step.py [--model DIR] [--batches 1 8 32] [--prompt-len 512] [--threads 2]
        [--new-tokens 128] [--rounds 3] [--context 512]

``NullLM`` has the checkpoint's cache geometry, vocabulary and tokenizer but computes nothing: its forward
returns the entries, hidden states and logits of the call's shapes from buffers made once (the logits pick
a different token id at each position, so the detokenizer sees ordinary text). Everything else is the real
``mlaq.LLM``: the scheduler, the block manager, the runner (inputs, the resident buffer, the paged-cache
writes of the new latents), the sampler, stop checks, detokenizing and the request outputs. Alternated in one
process with ``mlaq.LLM(compile=True)`` on the same checkpoint (bf16, greedy, ignore_eos, random prompt
ids; decode = (generate N+1 tokens - generate 1) / N), it gives the engine's share of a compiled step. Then
the floor (``roofline.py``'s bytes / bandwidth at ``--context`` cached tokens, bf16, the same threads) and
what 80 % of it leaves a step: the engine's work (choose the batch, build its inputs, sample, stop, detokenize)
and the model's follow each other, so a model exactly at the floor, stepped by this engine, reaches
floor / (floor + the engine's step) of the floor at most. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from decode_budget import decode_rate  # noqa: E402
from roofline import BUNDLED, active_params, read_bandwidth  # noqa: E402

from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.model_api import CacheGeometry, LMOutput  # noqa: E402
from mlaq.engine.tokenizer import Tokenizer  # noqa: E402


class NullLM:
    """A ``LatentLM`` of ``config``'s geometry whose calls cost only the building of their outputs."""

    accepts_room = True  # the runner keeps its resident buffer, as for mlaq's models
    room_dtype = torch.bfloat16

    def __init__(self, config: dict) -> None:
        self.config = config
        self._geometry = CacheGeometry(
            config["num_hidden_layers"],
            config.get("num_nextn_predict_layers", 0),
            config["kv_lora_rank"],
            config["qk_rope_head_dim"],
            torch.bfloat16,
        )
        self._zeros: dict[tuple[int, ...], Tensor] = {}

    @property
    def geometry(self) -> CacheGeometry:
        return self._geometry

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def _buffer(self, *shape: int) -> Tensor:
        if shape not in self._zeros:
            self._zeros[shape] = torch.zeros(shape, dtype=torch.bfloat16)
        return self._zeros[shape]

    def forward(self, input_ids: Tensor, positions: Tensor, past, *, prefill, logits_index=None, room=None):
        b, t = input_ids.shape
        rows = 1 if logits_index is not None else t
        g = self._geometry
        logits = torch.zeros(b, rows, self.vocab_size)
        token = (positions[:, -rows:] * 7919 + 101) % (self.vocab_size - 2) + 2  # never the eos id 1
        logits.scatter_(-1, token[..., None], 1.0)
        latent = self._buffer(b, t, g.kv_lora_rank + g.qk_rope_head_dim)
        hidden = self._buffer(b, t, self.config["hidden_size"])
        return LMOutput(logits, hidden, tuple(latent for _ in range(g.num_layers)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=BUNDLED)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=512, help="cached tokens S for the floor")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    config = json.loads((a.model / "config.json").read_text())
    tokenizer = Tokenizer.from_dir(a.model)
    engines = {
        "engine only (NullLM)": LLM(NullLM(config), tokenizer=tokenizer, max_num_seqs=max(a.batches)),
        "compile=True": LLM(a.model, compile=True, dtype=torch.bfloat16, max_num_seqs=max(a.batches)),
    }
    rng = random.Random(0)
    vocab = config["vocab_size"]
    for batch in a.batches:
        prompts = [
            {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(a.prompt_len)]} for _ in range(batch)
        ]
        for llm in engines.values():
            decode_rate(llm, prompts, 4)  # warm-up (compiles this batch shape)
        best = dict.fromkeys(engines, 0.0)
        for _ in range(a.rounds):
            for name, llm in engines.items():
                best[name] = max(best[name], decode_rate(llm, prompts, a.new_tokens))
        step = {name: batch / rate * 1e3 for name, rate in best.items()}  # ms a step (best round)
        share = step["engine only (NullLM)"] / step["compile=True"]
        print(
            f"batch {batch} x {a.prompt_len}: ms a step, best of {a.rounds}: "
            + ", ".join(f"{name} {ms:.3f}" for name, ms in step.items())
            + f"; the engine's share {share:.0%}",
            flush=True,
        )
        if batch == 1:
            engine_ms = step["engine only (NullLM)"]
    if 1 not in a.batches:
        return
    kv = config["num_hidden_layers"] * a.context * (config["kv_lora_rank"] + config["qk_rope_head_dim"])
    nbytes = (sum(active_params(config).values()) + kv) * 2
    floor = nbytes / read_bandwidth(nbytes, torch.bfloat16) * 1e3
    bound = floor + engine_ms  # the engine's work and the model's follow each other within a step
    print(
        f"floor at S = {a.context} (bf16 bytes / read bandwidth, {a.threads} threads): {floor:.3f} ms a token; "
        f"80 % of it allows {floor / 0.8:.3f} ms a step. The engine alone takes {engine_ms:.3f} ms a step: with "
        f"the model exactly at the floor a step takes >= {bound:.3f} ms, {floor / bound:.0%} of the floor at most; "
        f"80 % needs the engine's step under {floor / 0.8 - floor:.3f} ms and the model at the floor",
        flush=True,
    )


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s)")
