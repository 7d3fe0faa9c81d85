"""Continuous batching: admission, decode batches, preemption by recompute, stop conditions."""

from __future__ import annotations

import pytest

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.scheduler import Scheduler, SchedulerConfig
from mlaq.engine.sequence import FinishReason, Sequence, SequenceStatus, check_stop_token

EOS = 2


def make(num_blocks=16, block_size=4, max_model_len=32, max_num_seqs=3, lookahead=0) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_lookahead_slots=lookahead
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, max_model_len))


def seq(i: int, prompt_len: int, max_tokens: int = 4, **kw) -> Sequence:
    return Sequence(i, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens, **kw))


def run_fake_model(sched: Scheduler, max_steps: int = 500) -> list[tuple[bool, int]]:
    """Drive the scheduler with a stand-in model that emits token 5 every step."""
    trace = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return trace
        batch = sched.schedule()
        trace.append((batch.is_prefill, len(batch.seqs)))
        assert len(sched.running) <= sched.config.max_num_seqs
        for s in batch.seqs:
            assert sched.blocks.num_tokens(s.seq_id) >= s.num_tokens  # slots for every computed token
            s.num_cached = s.num_tokens
            s.append(5)
            check_stop_token(s, (EOS,), sched.config.max_model_len)
        sched.finish_done()
    raise AssertionError("did not finish")


def test_continuous_batching_admits_as_slots_free_up():
    sched = make(max_num_seqs=2)
    reqs = [seq(0, 3, max_tokens=2), seq(1, 5, max_tokens=6), seq(2, 2, max_tokens=1)]
    for r in reqs:
        sched.add(r)
    trace = run_fake_model(sched)
    # prefill {0, 1}; decode {0, 1} (0 done); prefill {2} (done at once); decode {1} ...
    assert trace[:3] == [(True, 2), (False, 2), (True, 1)]
    assert [len(r.output_token_ids) for r in reqs] == [2, 6, 1]
    assert all(r.finish_reason is FinishReason.LENGTH for r in reqs)
    assert sched.blocks.num_free_blocks == 16


def test_a_prompt_that_cannot_fit_is_rejected_on_add():
    sched = make(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="33 tokens does not fit max_model_len=32"):
        sched.add(seq(0, 33))
    with pytest.raises(ValueError, match="the KV cache pool has only 4"):
        sched.add(seq(1, 17))
    with pytest.raises(ValueError, match="the prompt is empty"):
        Sequence(2, [], SamplingParams())


def test_preemption_recomputes_and_everything_still_finishes():
    sched = make(num_blocks=5, block_size=4, max_model_len=20, max_num_seqs=3)
    reqs = [seq(i, 6, max_tokens=8) for i in range(3)]  # 3 x 14 tokens > 20 slots of the pool
    for r in reqs:
        sched.add(r)
    preempted = []
    for _ in range(200):
        if not sched.has_unfinished:
            break
        batch = sched.schedule()
        preempted += [s.seq_id for s in sched.waiting if s.output_token_ids]
        for s in batch.seqs:
            s.num_cached = s.num_tokens
            s.append(5)
            check_stop_token(s, (EOS,), 20)
        sched.finish_done()
    assert preempted, "the pool was meant to run dry"
    assert all(len(r.output_token_ids) == 8 and r.is_finished for r in reqs)
    assert sched.blocks.num_free_blocks == 5


def test_lookahead_slots_and_rollback():
    sched = make(lookahead=3, max_model_len=12)
    s = seq(0, 6, max_tokens=10)
    sched.add(s)
    sched.schedule()  # prefill: 6 slots
    s.num_cached = 6
    s.append(5)
    batch = sched.schedule()  # decode with k = 3: last token + 3 drafts -> 10 slots
    assert not batch.is_prefill and sched.blocks.num_tokens(0) == 10
    sched.rollback(s, 8)  # one draft accepted: the last token and that draft stay cached
    assert sched.blocks.num_tokens(0) == 8 and s.num_cached == 8
    s.output_token_ids += [5, 5, 5]  # 10 tokens now
    sched.schedule()
    assert sched.blocks.num_tokens(0) == 12  # capped at max_model_len, not 13


def test_stop_conditions_follow_vllm():
    s = seq(0, 3, max_tokens=10)
    s.append(EOS)
    assert check_stop_token(s, (EOS,), 64) and s.finish_reason is FinishReason.STOP and s.stop_reason is None
    s = seq(1, 3, max_tokens=10, ignore_eos=True, stop_token_ids=[9])
    s.append(EOS)
    assert not check_stop_token(s, (EOS,), 64)
    s.append(9)
    assert check_stop_token(s, (EOS,), 64) and s.stop_reason == 9
    s = seq(2, 3, max_tokens=10)
    s.append(4)
    assert check_stop_token(s, (EOS,), 4) and s.finish_reason is FinishReason.LENGTH
    assert s.status is SequenceStatus.FINISHED


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=64, max_num_batched_tokens=32)
