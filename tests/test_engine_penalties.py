"""min_tokens, logit_bias and vLLM's repetition / frequency / presence penalties: the arithmetic against
a hand-computed oracle and against vLLM's batched formula (bit for bit), which tokens count, the
order, the checks, and their effect through the engine (plain and speculative)."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.engine.outputs import fold
from mlaq.engine.penalties import adjusted_logits, apply_penalties
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.sequence import Sequence as Seq
from test_engine_generate import V
from test_engine_serving import drain_one, engine


def test_hand_computed_oracle():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -0.5, 1.0, 4.0])
    p = SamplingParams(
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias={"1": 2.0, 4: -100.0, 5: 10.0},
    )
    out = apply_penalties(logits, p, prompt=[0, 1, 6], output=[3, 3, 2])
    # bias:        [2, 1, 0.5, 3, -100.5, 11, 4]   (token 1: -1 + 2 = 1, BEFORE the repetition penalty)
    # repetition:  tokens 0, 1, 6 (prompt) and 2, 3 (output): positive / 2, negative * 2
    #              [1, 0.5, 0.25, 1.5, -100.5, 11, 2]
    # frequency:   output counts {3: 2, 2: 1}: 3 -> 1.5 - 1.0, 2 -> 0.25 - 0.5 (the prompt does not count)
    # presence:    tokens 2, 3 -> - 0.25
    expected = torch.tensor([1.0, 0.5, -0.5, 0.25, -100.5, 11.0, 2.0])
    assert torch.equal(out, expected), out


def test_min_tokens_masks_stops_then_the_rest_still_applies():
    logits = torch.tensor([1.0, 2.0, -3.0, 0.0])
    p = SamplingParams(min_tokens=2, stop_token_ids=[3], frequency_penalty=1.0, logit_bias={0: 5.0})
    early = apply_penalties(logits, p, prompt=[2], output=[1], eos_token_ids=[0])
    assert torch.equal(early, torch.tensor([-math.inf, 1.0, -3.0, -math.inf]))  # bias cannot lift -inf
    late = apply_penalties(logits, p, prompt=[2], output=[1, 1], eos_token_ids=[0])
    assert torch.equal(late, torch.tensor([6.0, 0.0, -3.0, 0.0]))


def vllm_batched(logits, prompts, outputs, presence, frequency, repetition):
    """vLLM's ``apply_penalties`` as written (padded token tensors, bin counts, masks; the CUDA
    kernel's repetition rule), over a whole batch at once: the reference for the per-row code."""
    b, v = logits.shape

    def counts(lists):
        width = max(max(len(t) for t in lists), 1)
        padded = torch.full((b, width), v, dtype=torch.int64)
        for i, t in enumerate(lists):
            padded[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        bins = torch.zeros(b, v + 1, dtype=torch.int64).scatter_add_(1, padded, torch.ones_like(padded))
        return bins[:, :v]

    out = logits.clone()
    prompt_mask, out_counts = counts(prompts) > 0, counts(outputs)
    rep = repetition[:, None].expand(b, v)
    hit = prompt_mask | (out_counts > 0)
    out = torch.where(hit, torch.where(out > 0, out / rep, out * rep), out)
    out -= frequency[:, None] * out_counts
    out -= presence[:, None] * (out_counts > 0)
    return out


def test_per_row_penalties_equal_vllms_batched_formula_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    b, v = 6, 97
    logits = torch.randn(b, v, generator=g) * 4
    prompts = [torch.randint(v, (n,), generator=g).tolist() for n in (5, 1, 12, 3, 7, 9)]
    outputs = [torch.randint(v, (n,), generator=g).tolist() for n in (0, 4, 11, 30, 2, 6)]
    presence = torch.tensor([0.0, 0.3, -1.7, 2.0, 0.11, -0.4])
    frequency = torch.tensor([0.7, -0.2, 1.3, 0.0, -2.0, 0.37])
    repetition = torch.tensor([1.0, 1.3, 0.77, 2.5, 1.1, 1.0])
    expected = vllm_batched(logits, prompts, outputs, presence, frequency, repetition)
    for i in range(b):
        p = SamplingParams(
            presence_penalty=float(presence[i]),
            frequency_penalty=float(frequency[i]),
            repetition_penalty=float(repetition[i]),
        )
        got = apply_penalties(logits[i], p, prompts[i], outputs[i])
        assert torch.equal(got, expected[i]), (i, (got - expected[i]).abs().max())


def test_draft_rows_count_earlier_drafts_as_output():
    p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    seq = Seq(0, [1, 2], p, output_token_ids=[3])
    rows = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    drafts = [4, 3]
    got = adjusted_logits(rows, seq, eos_token_ids=())
    assert got.shape == (3, 8)
    got = adjusted_logits(rows, seq, (), drafts)
    for i in range(3):
        want = apply_penalties(rows[i], p, [1, 2], [3, *drafts[:i]])
        assert torch.equal(got[i], want)
    assert not torch.equal(got[0], got[2])  # the drafts did change the later rows


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2, 2]"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number"),
        ({"repetition_penalty": -1.0}, "repetition_penalty must be greater than zero"),
        ({"logit_bias": {"abc": 1.0}}, "cannot be converted to integer token IDs: ['abc']"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be non-negative"),
        ({"logit_bias": {3: math.nan}}, "logit_bias values must be finite"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to biases"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kwargs)


def test_logit_bias_is_normalised_and_counts_as_penalized():
    p = SamplingParams(logit_bias={"7": 1, 2: -0.5})
    assert p.logit_bias == ((2, -0.5), (7, 1.0)) and p.penalized
    assert hash(p) == hash(SamplingParams(logit_bias=((7, 1.0), (2, -0.5))))
    assert not SamplingParams().penalized
    assert SamplingParams(presence_penalty=0.1).penalized and SamplingParams(frequency_penalty=-0.1).penalized


def test_engine_refuses_an_out_of_vocab_bias():
    with pytest.raises(ValueError, match=f"out-of-vocab token ids. Vocabulary size: {V}"):
        engine().add_request([3, 4], SamplingParams(logit_bias={V: 1.0}))


def test_greedy_follows_a_large_logit_bias():
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={17: 100.0})
    assert fold(drain_one(engine(), [3, 4], p)).outputs[0].token_ids == (17,) * 6


def test_presence_and_frequency_penalties_change_the_choice():
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = fold(drain_one(engine(), [3, 4], base)).outputs[0].token_ids
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        pen = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **kw)
        toks = fold(drain_one(engine(), [3, 4], pen)).outputs[0].token_ids
        assert toks != plain and len(set(toks)) > len(set(plain)), (kw, plain, toks)


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_with_every_adjustment_equals_plain(k):
    p = SamplingParams(
        temperature=0,
        max_tokens=12,
        min_tokens=3,
        stop_token_ids=[5],
        repetition_penalty=1.3,
        presence_penalty=0.8,
        frequency_penalty=0.6,
        logit_bias={9: 1.5, 2: -2.0},
    )
    plain = fold(drain_one(engine(), [3, 4, 9], p)).outputs[0].token_ids
    spec = fold(drain_one(engine(k=k), [3, 4, 9], p)).outputs[0].token_ids
    assert spec == plain
