"""One engine of ``bench/peer.py`` in its own process: timings and parity data as JSON.

    python bench/peer_engines.py ENGINE --job JOB.json --out OUT.json

ENGINE: ``vllm`` (run with vLLM's own interpreter), ``mlaq``, ``mlaq-compiled``, ``mlaq-autotune``, ``transformers``,
``mlaq-fp32`` (mlaq in float32 whatever the job's dtype: the reference of the bf16 noise floor).
Imports only what ENGINE needs at module level (vLLM's environment has no mlaq), and mlaq from this
checkout's ``src``. The job (written by ``bench/peer.py``): model, dtype, threads, new_tokens,
repeats, cells [{prompt_len, batch, k}], parity {prompts, new_tokens} or null.

Per cell: the same prompts in every engine (random ids seeded by prompt length and batch), greedy,
ignore_eos. ``ttft_s`` = the best wall time of ``generate(max_tokens=1)`` (prefill plus one
sampled token for every request); ``total_s`` = the best of ``generate(max_tokens=new_tokens)``;
decode tokens/s = batch * (new_tokens - 1) / (total_s - ttft_s). A warm-up call of the cell's own
shape runs first (compilation excluded; its time is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def prompt_ids(prompt_len: int, batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token ids (no torch: the same in every interpreter)."""
    import random

    rng = random.Random(seed * 1_000_003 + prompt_len * 1009 + batch)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


VLLM_CPU_MLA_BATCHED_TOKENS = 2048  # vllm.config.scheduler.SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS


# ---- vLLM ------------------------------------------------------------------------------------------
class VllmEngine:
    def __init__(self, job: dict[str, Any], k: int, max_len: int, max_seqs: int) -> None:
        from vllm import LLM

        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        self.llm = LLM(
            model=job["model"],
            dtype=job["dtype"],
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            skip_tokenizer_init=True,
            speculative_config=spec,
            seed=0,
            disable_log_stats=False,
            enforce_eager=bool(job.get("vllm_eager")),  # eager: vLLM's custom ops (its C++ rope op) run
        )

    def generate(self, prompts: list[list[int]], new: int, logprobs: int | None = None) -> list[Any]:
        from vllm import SamplingParams

        sp = SamplingParams(
            temperature=0, max_tokens=new, ignore_eos=True, detokenize=False, logprobs=logprobs
        )
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [
            (list(o.outputs[0].token_ids), _vllm_logprobs(o.outputs[0].logprobs) if logprobs else None)
            for o in outs
        ]

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=1, detokenize=False, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        result = []
        for p, o in zip(prompts, outs, strict=True):
            lps = o.prompt_logprobs  # [None, {token: Logprob}, ...]
            result.append([float(lps[t][p[t]].logprob) for t in range(1, len(p))])
        return result

    def spec_counters(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            for m in self.llm.get_metrics():
                if m.name.startswith("vllm:spec_decode"):
                    out[m.name] = m.value if hasattr(m, "value") else getattr(m, "values", None)
        except Exception as e:  # metrics are a report extra, never fatal
            out["error"] = repr(e)
        return out


def _vllm_logprobs(lps: Any) -> list[list[tuple[int, float]]]:
    """Per position the (token, logprob) pairs, best first."""
    rows = []
    for d in lps:
        rows.append(sorted(((int(t), float(v.logprob)) for t, v in d.items()), key=lambda x: -x[1]))
    return rows


# ---- mlaq ------------------------------------------------------------------------------------------
class MlaqEngine:
    def __init__(
        self, job: dict[str, Any], k: int, max_len: int, max_seqs: int, compile: bool, autotune: bool = False
    ) -> None:
        import torch

        sys.path.insert(0, str(REPO / "src"))
        from mlaq.engine.llm import LLM

        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        self.torch = torch
        self.llm = LLM(
            job["model"],
            dtype=getattr(torch, job["dtype"]),
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            # vLLM-CPU's for MLA models (chunked prefill off): max(max_model_len, 2048) prompt tokens a
            # step (its log: "MLA is enabled on a non-GPU platform"); both engines batch prompts alike
            max_num_batched_tokens=max(max_len, VLLM_CPU_MLA_BATCHED_TOKENS),
            speculative_config=spec,
            compile=compile,
            compilation_config={"inductor_compile_config": {"max_autotune": True}} if autotune else None,
        )

    def generate(self, prompts: list[list[int]], new: int, logprobs: int | None = None) -> list[Any]:
        from mlaq.engine.sampling_params import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=logprobs)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        res = []
        for o in outs:
            c = o.outputs[0]
            lp = None
            if logprobs:
                lp = [sorted(d.items(), key=lambda x: -x[1]) for d in c.logprobs]
            res.append((list(c.token_ids), lp))
        return res

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        torch = self.torch
        model = self.llm.engine.model.model  # DeepseekForCausalLM (eager or under CompiledLatentLM)
        ids = torch.tensor(prompts)
        logits = model.prefill(ids).logits.float()  # the engine's prefill path (naive MLA)
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        return lp.tolist()

    def spec_counters(self) -> dict[str, Any]:
        s = self.llm.spec_decoding_stats
        if s is None:
            return {}
        return {
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "mean_acceptance_length": s.mean_acceptance_length,
        }


# ---- transformers ----------------------------------------------------------------------------------
class TransformersEngine:
    def __init__(self, job: dict[str, Any], k: int, max_len: int, max_seqs: int) -> None:
        import torch
        import transformers

        if k:
            raise ValueError("transformers generate has no MTP speculative decoding")
        transformers.logging.set_verbosity_error()  # MTP tensors it does not know are expected
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            job["model"], dtype=getattr(torch, job["dtype"])
        ).eval()

    def generate(self, prompts: list[list[int]], new: int, logprobs: int | None = None) -> list[Any]:
        torch = self.torch
        ids = torch.tensor(prompts)
        kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        return [(row[ids.shape[1] :].tolist(), None) for row in out]

    def prompt_logprobs(self, prompts: list[list[int]]) -> list[list[float]]:
        torch = self.torch
        ids = torch.tensor(prompts)
        with torch.no_grad():
            logits = self.model(ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        return lp.tolist()

    def spec_counters(self) -> dict[str, Any]:
        return {}


def make(engine: str, job: dict[str, Any], k: int, max_len: int, max_seqs: int) -> Any:
    if engine == "vllm":
        return VllmEngine(job, k, max_len, max_seqs)
    if engine in ("mlaq", "mlaq-compiled", "mlaq-autotune"):
        compiled = engine != "mlaq"
        return MlaqEngine(job, k, max_len, max_seqs, compile=compiled, autotune=engine == "mlaq-autotune")
    if engine == "mlaq-fp32":
        return MlaqEngine({**job, "dtype": "float32"}, k, max_len, max_seqs, compile=False)
    if engine == "transformers":
        return TransformersEngine(job, k, max_len, max_seqs)
    raise ValueError(f"unknown engine {engine!r}")


def run(engine: str, job: dict[str, Any]) -> dict[str, Any]:
    new, repeats, vocab = job["new_tokens"], job["repeats"], job["vocab_size"]
    cells = job["cells"]
    max_len = max([c["prompt_len"] for c in cells] + [job["parity"]["prompt_len"] if job["parity"] else 0])
    max_len += max(new, job["parity"]["new_tokens"] if job["parity"] else 0) + 8
    max_seqs = max([c["batch"] for c in cells] + [job["parity"]["prompts"] if job["parity"] else 1])
    results: dict[str, Any] = {"engine": engine, "cells": [], "startup_s": {}}
    for k in sorted({c["k"] for c in cells} | ({0} if job["parity"] else set())):
        start = time.perf_counter()
        try:
            eng = make(engine, job, k, max_len, max_seqs)
        except Exception as e:  # reported per k (e.g. MTP unsupported)
            results["startup_s"][str(k)] = None
            for c in cells:
                if c["k"] == k:
                    results["cells"].append({**c, "error": f"{type(e).__name__}: {e}"[:400]})
            print(f"[{engine}] k={k}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            continue
        results["startup_s"][str(k)] = time.perf_counter() - start
        if k == 0 and job["parity"]:
            results["parity"] = parity(eng, job, vocab)
        for c in cells:
            if c["k"] != k:
                continue
            prompts = prompt_ids(c["prompt_len"], c["batch"], vocab)
            start = time.perf_counter()
            eng.generate(prompts, new if engine in ("mlaq-compiled", "mlaq-autotune") or k else 2)
            warm = time.perf_counter() - start
            before = eng.spec_counters()
            ttft, _ = timed(lambda p=prompts, e=eng: e.generate(p, 1), repeats)
            total, outs = timed(lambda p=prompts, e=eng: e.generate(p, new), repeats)
            row = {**c, "warmup_s": warm, "ttft_s": ttft, "total_s": total}
            row["generated"] = sum(len(t) for t, _ in outs)
            row["spec_before"], row["spec_after"] = before, eng.spec_counters()
            results["cells"].append(row)
            print(f"[{engine}] {json.dumps(row)}", file=sys.stderr, flush=True)
        eng = None  # free this k's engine (its KV cache) before the next one starts
    return results


def parity(eng: Any, job: dict[str, Any], vocab: int) -> dict[str, Any]:
    par = job["parity"]
    prompts = prompt_ids(par["prompt_len"], par["prompts"], vocab, seed=7)
    out: dict[str, Any] = {"prompt_logprobs": eng.prompt_logprobs(prompts)}
    gen = eng.generate(
        prompts, par["new_tokens"], logprobs=None if isinstance(eng, TransformersEngine) else 2
    )
    out["tokens"] = [t for t, _ in gen]
    out["top_logprobs"] = [lp for _, lp in gen]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("engine")
    p.add_argument("--job", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    job = json.loads(a.job.read_text())
    if a.engine != "vllm":
        import torch

        torch.set_num_threads(job["threads"])
    if a.engine.startswith("mlaq"):  # what mlaq generate / serve / validate do (mlaq.libc)
        from mlaq.libc import keep_freed_memory

        keep_freed_memory()
    result = run(a.engine, job)
    result["pid_threads"] = job["threads"]
    result["env"] = {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_"))}
    a.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
