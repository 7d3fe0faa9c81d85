"""Engine additions the server needs: abort frees blocks, prompt logprobs (teacher-forced), max_tokens=0,
min_tokens, repetition_penalty, logprobs over the whole vocabulary, per-request spec steps."""

from __future__ import annotations

import pytest
import torch

from mlaq.engine.engine import EngineConfig, LLMEngine
from mlaq.engine.outputs import fold
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats
from test_engine_generate import L, R, ToyLM, V


def engine(model: ToyLM | None = None, k: int = 0, **config) -> LLMEngine:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    cfg = EngineConfig(max_model_len=64, max_num_seqs=4, block_size=4, speculative_config=spec, **config)
    return LLMEngine(model or ToyLM(), cfg, eos_token_ids=(0,))


def drain(e: LLMEngine) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while e.has_unfinished_requests:
        for d in e.step():
            deltas.setdefault(d.request_id, []).append(d)
    return deltas


def teacher_forced(model: ToyLM, prompt: list[int]) -> torch.Tensor:
    """(T-1,) log p(prompt[t] | prompt[:t]) by one uncached forward pass."""
    empty = torch.zeros(1, 0, L + R, dtype=torch.float64)
    out = model.forward(torch.tensor([prompt]), torch.arange(len(prompt))[None], [empty] * 2, prefill=True)
    lp = torch.log_softmax(out.logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def test_abort_frees_blocks_and_others_continue():
    e = engine()
    free = e.scheduler.blocks.num_free_blocks
    a = e.add_request([3, 4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    b = e.add_request([5, 6], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    e.step()
    e.step()
    assert e.kv_cache_usage > 0 and e.num_running == 2
    assert e.abort(a) and not e.abort(a) and not e.abort("nope")
    assert e.num_running == 1
    out = drain(e)
    assert set(out) == {b} and len(fold(out[b]).outputs[0].token_ids) == 5 - 2  # b went on
    assert e.scheduler.blocks.num_free_blocks == free and e.kv_cache_usage == 0.0
    c = e.add_request([1, 2], SamplingParams(max_tokens=2))  # a waiting request can be aborted too
    assert e.num_waiting == 1 and e.abort(c) and e.num_waiting == 0 and not e.has_unfinished_requests


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_are_the_teacher_forced_log_softmax(k):
    model = ToyLM()
    prompt = [3, 9, 1, 4, 7, 2, 8]
    e = engine(model, k)
    rid = e.add_request(prompt, SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=3))
    e.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4))  # batched with a plain prefill
    out = fold(drain(e)[rid])
    assert out.outputs[0].token_ids == () and out.outputs[0].finish_reason == "length"  # max_tokens=0
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    got = torch.tensor([plp[t][prompt[t]] for t in range(1, len(prompt))], dtype=torch.float64)
    torch.testing.assert_close(got, teacher_forced(model, prompt).double(), atol=1e-5, rtol=0)
    assert all(len(entry) in (3, 4) for entry in plp[1:])  # the prompt token plus the top 3


def test_whole_vocabulary_logprobs():
    e = engine()
    rid = e.add_request([3, 4], SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1))
    out = fold(drain(e)[rid])
    assert all(len(entry) == V for entry in out.outputs[0].logprobs)
    assert len(out.prompt_logprobs[1]) == V
    probs = torch.tensor(list(out.outputs[0].logprobs[0].values())).exp().sum()
    assert abs(float(probs) - 1.0) < 1e-5


def test_min_tokens_blocks_eos_and_stop_tokens():
    model = ToyLM()
    e = engine(model)
    first = fold(drain_one(e, [3, 4], SamplingParams(temperature=0, max_tokens=8))).outputs[0].token_ids
    stop = first[0]  # greedy's first token, used as a stop token
    plain = fold(drain_one(e, [3, 4], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])))
    assert plain.outputs[0].token_ids == (stop,)
    held = (
        fold(
            drain_one(
                e, [3, 4], SamplingParams(temperature=0, max_tokens=8, min_tokens=3, stop_token_ids=[stop])
            )
        )
        .outputs[0]
        .token_ids
    )
    assert len(held) >= 3 and stop not in held[:3]


def drain_one(e: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    rid = e.add_request(prompt, params)
    return drain(e)[rid]


def test_repetition_penalty_changes_the_choice_like_vllm():
    e = engine()
    base = fold(drain_one(e, [3, 4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    pen = fold(
        drain_one(
            e, [3, 4], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=50.0)
        )
    )
    toks = pen.outputs[0].token_ids
    assert toks != base.outputs[0].token_ids
    assert len(set(toks)) > len(set(base.outputs[0].token_ids))  # a strong penalty repeats less


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_penalties_equals_plain(k):
    p = SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.7, min_tokens=4, stop_token_ids=[5])
    plain = fold(drain_one(engine(), [3, 4, 9], p)).outputs[0].token_ids
    spec = fold(drain_one(engine(k=k), [3, 4, 9], p)).outputs[0].token_ids
    assert spec == plain


def test_per_request_spec_steps_add_up_to_the_stats():
    e = engine(k=2)
    ids = [
        e.add_request([3, 4, i], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)) for i in (5, 6)
    ]
    outs = drain(e)
    total = SpecDecodingStats.new(2)
    for rid in ids:
        final = outs[rid][-1]
        assert final.finished and final.spec_steps
        stats = SpecDecodingStats.new(2)
        for drafted, accepted in final.spec_steps:
            stats = stats.observe(drafted, accepted)
        assert stats == final.spec_decoding_stats
        total = total + stats
    assert total == e.spec_decoding_stats


def test_sampling_params_new_fields_are_checked():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=2)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-3)
    assert SamplingParams(max_tokens=0).max_tokens == 0
