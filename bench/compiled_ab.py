"""Decode tokens/s of ``mlaq.LLM`` with ``compile=True`` against another engine, alternated in one
process (a virtual machine's speed drifts: only side-by-side figures mean anything).

    python bench/compiled_ab.py BATCH [--against eager|unfolded|torch|autotune|pieces|unfused] [--prompt-len 512] [--new-tokens 48]
        [--rounds 3] [--threads 2] [--model DIR]

``--against eager`` (default): the eager engine. ``--against unfolded``: ``compile=True`` with the
absorbed BMMs run eagerly beside the attention (``CompiledLatentLM(fold_bmms=False)``, the older
design) instead of inside the compiled pieces. ``--against torch``: ``compile=True`` attending with
torch's fused kernel (``CompiledLatentLM(attention="torch")``, the older design) instead of mlaq's.
``--against autotune``: ``compile=True`` against itself with vLLM's ``compilation_config=
{"inductor_compile_config": {"max_autotune": true}}`` (its warm-up is about a minute longer). ``--against pieces``: ``compile=True`` with the
``bf16`` scheme's BMMs inside the compiled pieces (``CompiledLatentLM(kernel_bmms=False)``)
instead of in mlaq's kernel beside the attention. ``--against unfused``: ``compile=True`` without vLLM's fused
linears (``CompiledLatentLM(fuse_linears=False)``: q_a / kv_a and gate / up as separate GEMMs).
Both engines load the same checkpoint (bundled mlaq-tiny-4k by default) in bf16; greedy, ignore_eos,
random prompt ids; decode = (generate N+1 tokens - generate 1) / N. Warm-ups (compiles for this batch
shape) are printed and excluded. Not a test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from mlaq.engine.compiled import CompiledLatentLM  # noqa: E402
from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.model import load_model  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from decode_budget import ab_setup, decode_rate  # noqa: E402


def main() -> None:
    a, prompts = ab_setup(__doc__, against=["eager", "unfolded", "torch", "autotune", "pieces", "unfused"])
    kw = {"max_num_seqs": max(a.batch, 16)}
    if a.against == "autotune":
        tuned = {"inductor_compile_config": {"max_autotune": True}}
        other = LLM(a.model, compile=True, dtype=torch.bfloat16, compilation_config=tuned, **kw)
    elif a.against == "eager":
        other = LLM(a.model, dtype=torch.bfloat16, **kw)
    else:
        choices = {
            "unfolded": {"fold_bmms": False},
            "torch": {"attention": "torch"},
            "pieces": {"kernel_bmms": False},
            "unfused": {"fuse_linears": False},
        }
        choice = choices[a.against]
        other = LLM(CompiledLatentLM(load_model(a.model, dtype=torch.bfloat16), **choice), **kw)
    engines = {a.against: other, "compiled": LLM(a.model, compile=True, dtype=torch.bfloat16, **kw)}
    for name, llm in engines.items():
        t0 = time.perf_counter()
        decode_rate(llm, prompts, 4)
        print(f"{name} warm-up {time.perf_counter() - t0:.1f} s", flush=True)
    print(f"batch {a.batch} x {a.prompt_len}-token prompts, decode tokens/s: " + " / ".join(engines))
    for _ in range(a.rounds):
        rates = [decode_rate(llm, prompts, a.new_tokens) for llm in engines.values()]
        print(" / ".join(f"{r:.0f}" for r in rates), flush=True)


if __name__ == "__main__":
    main()
