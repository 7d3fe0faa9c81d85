"""SamplingParams validation and the sampler: vLLM's order, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.engine.sampler import draw, processed_logits, sample
from mlaq.engine.sampling_params import SamplingParams, as_params_list
from stats_helpers import chi_square


def kept(params: SamplingParams, probs: list[float]) -> set[int]:
    x = processed_logits(torch.tensor([probs]).log(), [params])[0]
    return {i for i, v in enumerate(x.tolist()) if v != float("-inf")}


# -- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be non-negative"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
        ({"max_tokens": -1}, "max_tokens must be at least 0"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"stop": ["ok", ""]}, "stop must be"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids must be non-negative"),
        ({"logprobs": -2}, "logprobs must be non-negative"),
        ({"temperature": float("nan")}, "temperature must be non-negative"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalises_like_vllm():
    p = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2, stop="END", logprobs=True)
    assert p.greedy and (p.top_k, p.top_p, p.min_p) == (0, 1.0, 0.0)  # greedy ignores truncation
    assert p.stop == ("END",) and p.logprobs == 0 and p.max_stop_len == 3
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's epsilon
    assert SamplingParams(logprobs=False).logprobs is None
    with pytest.raises(ValueError, match=r"unknown sampling parameter.*'n'"):
        SamplingParams.from_dict({"n": 2})
    assert as_params_list(p, 3) == [p, p, p]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        as_params_list([p, p], 3)


# -- truncation, in vLLM's order --------------------------------------------------------------


def test_top_k_top_p_min_p_keep_the_right_tokens():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert kept(SamplingParams(top_k=2), probs) == {0, 1}
    assert kept(SamplingParams(top_p=0.75), probs) == {0, 1}  # mass before token 2 is 0.8 >= p
    assert kept(SamplingParams(top_p=0.85), probs) == {0, 1, 2}
    assert kept(SamplingParams(top_p=0.01), probs) == {0}  # the top token always survives
    assert kept(SamplingParams(min_p=0.5), probs) == {0, 1}  # threshold 0.25
    assert kept(SamplingParams(), probs) == {0, 1, 2, 3}
    assert kept(SamplingParams(top_k=2), [0.4, 0.2, 0.2, 0.2]) == {0, 1, 2, 3}  # ties with k-th kept


def test_min_p_comes_before_top_p():
    # min_p=0.6 keeps {0, 1}; renormalised (4/7, 3/7), top_p=0.5 then keeps only {0}.
    # The other order (top_p first on the raw distribution) would keep {0, 1}.
    assert kept(SamplingParams(min_p=0.6, top_p=0.5), [0.4, 0.3, 0.2, 0.1]) == {0}


def test_temperature_comes_before_min_p():
    # At T=2 the probabilities are ∝ sqrt(p): token 1 has 0.775 of the top's mass, above min_p=0.7.
    # Applied to the raw distribution it would have 0.6 and be dropped.
    assert kept(SamplingParams(temperature=2.0, min_p=0.7), [0.5, 0.3, 0.2]) == {0, 1}


def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    x = processed_logits(logits, [SamplingParams(temperature=0.5)])
    torch.testing.assert_close(x, logits / 0.5)


# -- drawing ----------------------------------------------------------------------------------


def test_draw_follows_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6, dtype=torch.long)
    for _ in range(4000):
        counts[draw(probs, gen)] += 1
    # df = 4; P(chi2 > 25) ~ 5e-5. A sampler off by a few percent lands far above.
    assert chi_square(counts, probs) < 25.0, counts


def test_sampled_tokens_stay_inside_top_k():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    allowed = set(logits[0].topk(3).indices.tolist())
    p = SamplingParams(temperature=1.5, top_k=3)
    gen = torch.Generator().manual_seed(2)
    seen = {int(sample(logits, [p], [gen]).token_ids[0]) for _ in range(200)}
    assert seen == allowed


def test_greedy_is_argmax_of_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(3))
    out = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_seeded_request_is_reproducible_whatever_the_batch():
    vocab = 40
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    other = SamplingParams(temperature=1.3)

    def run(rows: int, position: int, steps: int = 8) -> list[int]:
        gens = [torch.Generator().manual_seed(seeded.seed if r == position else 99 + r) for r in range(rows)]
        params = [seeded if r == position else other for r in range(rows)]
        logits_gen = torch.Generator().manual_seed(7)
        tokens = []
        for _ in range(steps):
            logits = torch.randn(rows, vocab, generator=logits_gen)
            logits[position] = torch.linspace(-2, 2, vocab)  # the seeded request sees the same logits
            tokens.append(int(sample(logits, params, gens).token_ids[position]))
        return tokens

    alone = run(1, 0)
    assert run(5, 3) == alone and run(3, 0) == alone
    assert len(set(alone)) > 1  # it really sampled


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = SamplingParams(temperature=0.5, top_k=2, logprobs=2, seed=0)
    out = sample(logits, [p], [torch.Generator().manual_seed(0)])
    raw = torch.log_softmax(logits, dim=-1)[0]
    token = int(out.token_ids[0])
    assert out.logprobs[0].item() == pytest.approx(raw[token].item())
    assert out.top_token_ids.tolist() == [[0, 1]]
    torch.testing.assert_close(out.top_logprobs[0], raw[:2])
    assert math.isclose(
        out.top_logprobs[0].exp().sum().item() + raw[2:].exp().sum().item(), 1.0, rel_tol=1e-6
    )


def test_sampler_without_logprobs_chooses_the_same_tokens():
    """logprobs=False (the engine's decode loop) skips the log_softmax, not the choice or the RNG."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1), SamplingParams(top_k=5)]
    with_lp = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)])
    without = sample(logits, params, [torch.Generator().manual_seed(i) for i in range(3)], logprobs=False)
    assert torch.equal(with_lp.token_ids, without.token_ids)
    assert with_lp.logprobs is not None and without.logprobs is None and without.top_token_ids is None


def test_sampler_checks_shapes():
    with pytest.raises(ValueError, match="do not fit 2 requests"):
        sample(torch.zeros(3, 5), [SamplingParams()] * 2, [None] * 2)
    with pytest.raises(ValueError, match="1 generators for 2 rows"):
        sample(torch.zeros(2, 5), [SamplingParams()] * 2, [None])
