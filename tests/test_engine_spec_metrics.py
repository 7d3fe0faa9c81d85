"""Spec-decode metrics: engines.md's definitions on a scripted accept/reject sequence."""

from __future__ import annotations

import math
import random

import pytest

from mlaq.engine.spec_metrics import SpecDecodingStats

# The seed's measurement (GLM-5.2-MXFP4, MTP, k = 5): 66 drafts, 330 draft tokens, 193 accepted,
# per position 0.909, 0.727, 0.545, 0.424, 0.318. How many drafts accepted exactly n tokens:
ACCEPTED_HISTOGRAM = {0: 6, 1: 12, 2: 12, 3: 8, 4: 7, 5: 21}
SEED_LINE = (
    "SpecDecoding metrics: Mean acceptance length: 3.92, Accepted throughput: 19.30 tokens/s, "
    "Drafted throughput: 33.00 tokens/s, Accepted: 193 tokens, Drafted: 330 tokens, "
    "Per-position acceptance rate: 0.909, 0.727, 0.545, 0.424, 0.318, Avg Draft acceptance rate: 58.5%"
)


def scripted_events(seed: int = 0) -> list[int]:
    events = [n for n, count in ACCEPTED_HISTOGRAM.items() for _ in range(count)]
    random.Random(seed).shuffle(events)
    return events


def test_seed_numbers_are_reproduced():
    stats = SpecDecodingStats.new(5)
    for n in scripted_events():
        stats = stats.observe(5, n)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (66, 330, 193)
    assert stats.num_accepted_tokens_per_pos == (60, 48, 36, 28, 21)
    assert stats.mean_acceptance_length == pytest.approx(1 + 193 / 66)
    assert stats.draft_acceptance_rate == pytest.approx(193 / 330)
    assert [round(r, 3) for r in stats.per_position_acceptance_rate] == [0.909, 0.727, 0.545, 0.424, 0.318]
    assert stats.log_line(elapsed_s=10.0) == SEED_LINE


def test_merging_requests_equals_one_stream():
    events = scripted_events(1)
    whole = SpecDecodingStats.new(5)
    parts = [SpecDecodingStats.new(5) for _ in range(3)]
    for i, n in enumerate(events):
        whole = whole.observe(5, n)
        parts[i % 3] = parts[i % 3].observe(5, n)
    assert parts[0] + parts[1] + parts[2] == whole
    assert SpecDecodingStats() + whole == whole  # empty counters are the identity


def test_requests_with_different_k_merge_position_by_position():
    a = SpecDecodingStats.new(2).observe(2, 2)
    b = SpecDecodingStats.new(4).observe(4, 3)
    merged = a + b
    assert merged.num_accepted_tokens_per_pos == (2, 2, 1, 0)
    assert merged.num_draft_tokens == 6 and merged.num_drafts == 2


def test_invalid_observation():
    with pytest.raises(ValueError, match="accepted 4 of 3"):
        SpecDecodingStats.new(3).observe(3, 4)
    with pytest.raises(ValueError, match="num_spec_tokens must be at least 1"):
        SpecDecodingStats.new(0)


def test_no_drafts_yet_is_nan_not_a_crash():
    stats = SpecDecodingStats.new(2)
    assert math.isnan(stats.mean_acceptance_length) and math.isnan(stats.draft_acceptance_rate)
    assert "Mean acceptance length: nan" in stats.log_line()


def test_prometheus_counters_use_vllm_names():
    stats = SpecDecodingStats.new(2).observe(2, 1).observe(2, 2)
    text = stats.prometheus({"model_name": "tiny"})
    assert "# TYPE vllm:spec_decode_num_drafts counter" in text
    assert 'vllm:spec_decode_num_drafts_total{model_name="tiny"} 2.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="tiny"} 4.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"} 3.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 1.0' in text
