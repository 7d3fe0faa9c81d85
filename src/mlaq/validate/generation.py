"""Free-running greedy generation through mlaq's engine, with MTP speculative decoding when k >= 1.

Prompts are prefilled with the naive MLA path (its kv_b weights per ``--precision``), tokens are then
decoded with the absorbed path. Under greedy sampling speculative decoding emits exactly the tokens
plain greedy decoding emits (the engine's contract), so one run gives both the generated text (for
divergence and repetition) and the acceptance counters, in vLLM's definitions, with the draft (MTP
layer) and the target both under the variant's BMMs. EOS is ignored so every prompt yields the same
number of tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mlaq.engine.adapter import DeepseekLatentLM
from mlaq.engine.llm import LLM
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.model import DeepseekForCausalLM
from mlaq.validate.metrics import first_divergence, longest_loop, repeated_ngram_share


@dataclass(frozen=True)
class Generation:
    tokens: tuple[tuple[int, ...], ...]  # generated ids per prompt
    stats: SpecDecodingStats | None  # None without speculation
    seconds: float


def generate(
    model: DeepseekForCausalLM,
    prompts: list[list[int]],
    *,
    max_tokens: int,
    num_speculative_tokens: int,
    max_model_len: int,
    seed: int,
) -> Generation:
    """Greedy completions of ``prompts`` (token ids)."""
    spec = (
        {"method": "mtp", "num_speculative_tokens": num_speculative_tokens}
        if num_speculative_tokens
        else None
    )
    llm = LLM(
        DeepseekLatentLM(model),
        max_model_len=max_model_len,
        max_num_seqs=len(prompts),
        speculative_config=spec,
        seed=seed,
        eos_token_ids=(),
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    return Generation(tuple(o.outputs[0].token_ids for o in outs), llm.spec_decoding_stats, seconds)


def acceptance_json(stats: SpecDecodingStats | None) -> dict[str, Any]:
    """vLLM's counters and rates (None everywhere without speculation)."""
    if stats is None:
        keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
        rates = ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance_rate")
        return dict.fromkeys(keys + rates)
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos),
        "acceptance_rate": _finite(stats.draft_acceptance_rate),
        "mean_acceptance_length": _finite(stats.mean_acceptance_length),
        "per_position_acceptance_rate": [_finite(r) for r in stats.per_position_acceptance_rate],
    }


def generation_json(gen: Generation, reference: Generation | None, ngram: int) -> dict[str, Any]:
    """Repetition of ``gen`` and (against ``reference``) where it first diverges."""
    shares = [repeated_ngram_share(t, ngram) for t in gen.tokens]
    loops = [longest_loop(t) for t in gen.tokens]
    out: dict[str, Any] = {
        "repeated_ngram_share": sum(shares) / len(shares),
        "longest_loop": max(loops),
        "per_prompt_repeated_ngram_share": shares,
        "per_prompt_longest_loop": loops,
        "seconds": gen.seconds,
    }
    if reference is not None:
        firsts = [first_divergence(r, t) for r, t in zip(reference.tokens, gen.tokens, strict=True)]
        lengths = [len(t) for t in gen.tokens]
        # A prompt that never diverges counts with its full length (a lower bound of its divergence).
        counted = [n if f is None else f for f, n in zip(firsts, lengths, strict=True)]
        out["first_divergence"] = firsts
        out["first_divergence_mean"] = sum(counted) / len(counted)
        out["identical_generations"] = sum(f is None for f in firsts)
    return out


def _finite(x: float) -> float | None:
    return None if x != x else x  # nan (no drafts) -> null in JSON
