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

from mlaq.engine.adapter import DeepseekLatentLM
from mlaq.engine.llm import LLM
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.model import DeepseekForCausalLM


@dataclass(frozen=True)
class Generation:
    tokens: tuple[tuple[int, ...], ...]  # generated ids per prompt
    stats: SpecDecodingStats | None  # None without speculation
    seconds: float
    per_request: tuple[tuple[int, int], ...] | None = None  # (draft tokens, accepted tokens) per prompt


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
    per_request = None
    if spec is not None:
        per = [o.spec_decoding_stats or SpecDecodingStats() for o in outs]
        per_request = tuple((s.num_draft_tokens, s.num_accepted_tokens) for s in per)
    return Generation(
        tuple(o.outputs[0].token_ids for o in outs), llm.spec_decoding_stats, seconds, per_request
    )
