"""The speculative accept/reject step: exact under greedy, distribution-preserving when sampling."""

from __future__ import annotations

import pytest
import torch

from mlaq.engine.rejection import rejection_sample
from stats_helpers import chi_square

V = 6  # small vocabulary: every cell of the chi-square test gets hundreds of counts


def logits_with_argmax(ids: list[int], vocab: int = V) -> torch.Tensor:
    x = torch.zeros(len(ids), vocab)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 5.0
    return x


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4]),  # all accepted + bonus
        ([1, 2, 3], [1, 5, 3, 4], [1, 5]),  # mismatch at 1: target's token there, nothing after
        ([1, 2, 3], [0, 2, 3, 4], [0]),  # first rejected
        ([1, 2, 3], [1, 2, 0, 4], [1, 2, 0]),  # a later match after a mismatch does not count
        ([4], [4, 2], [4, 2]),
    ],
)
def test_greedy_accepts_the_matching_prefix_then_the_targets_token(draft, target, expected):
    out = rejection_sample(torch.tensor(draft), logits_with_argmax(target), greedy=True)
    assert out.tolist() == expected


def test_greedy_ignores_draft_probs_and_generator():
    draft = torch.tensor([1, 2])
    target = logits_with_argmax([1, 3, 0])
    a = rejection_sample(draft, target, torch.rand(2, V), greedy=True, generator=torch.Generator())
    assert a.tolist() == [1, 3]


def test_shape_error():
    with pytest.raises(ValueError, match="need k\\+1"):
        rejection_sample(torch.tensor([1, 2]), torch.zeros(2, V), greedy=True)


def distributions(seed: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, dim=-1)


def test_sampled_output_has_the_targets_distribution():
    """Chi-square: first and second emitted tokens follow p_1 and p_2, not the draft's q."""
    k, n = 2, 6000
    p = distributions(0, k + 1)  # (k+1, V) target, fixed per position
    q = distributions(1, k)  # (k, V) draft, far from p
    p[0, 5] = 0.0  # a token the target never emits but the draft likes
    p[0] /= p[0].sum()
    q[0, 5] += 1.0
    q[0] /= q[0].sum()
    target_logits = p.log()
    g_draft, g_verify = torch.Generator().manual_seed(10), torch.Generator().manual_seed(11)
    first = torch.zeros(V, dtype=torch.long)
    second = torch.zeros(V, dtype=torch.long)
    accepted_first = 0
    for _ in range(n):
        draft = torch.multinomial(q, 1, generator=g_draft)[:, 0]  # (k,) x_i ~ q_i
        out = rejection_sample(draft, target_logits, q, greedy=False, generator=g_verify)
        first[out[0]] += 1
        accepted_first += int(out[0] == draft[0] and len(out) > 1)
        if len(out) > 1:
            second[out[1]] += 1
    # df <= 5; P(chi2_5 > 30) ~ 1.5e-5: a fixed, generous threshold. Emitting the draft's
    # distribution instead (accept always) scores in the thousands.
    assert chi_square(first, p[0]) < 30.0, (first, p[0] * n)
    assert chi_square(second, p[1]) < 30.0, (second, p[1] * second.sum())
    # Theory: P(accept x_1) = sum_y min(p_1(y), q_1(y)) = 1 - TV(p_1, q_1).
    expected_rate = float(torch.minimum(p[0], q[0]).sum())
    assert abs(accepted_first / n - expected_rate) < 4 * (expected_rate * (1 - expected_rate) / n) ** 0.5


def test_one_hot_drafts_keep_the_targets_distribution():
    """MTP drafts greedily (q one-hot on x): accept with p(x), else resample from p without x."""
    p = distributions(2, 2)  # k = 1
    draft = torch.tensor([int(p[0].argmax())])
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(V, dtype=torch.long)
    n = 4000
    for _ in range(n):
        counts[rejection_sample(draft, p.log(), None, greedy=False, generator=g)[0]] += 1
    assert chi_square(counts, p[0]) < 30.0, (counts, p[0] * n)


def test_bonus_token_is_drawn_from_the_last_position():
    p = distributions(3, 2)
    draft = torch.tensor([0])
    q = torch.zeros(1, V)
    q[0, 0] = 1.0
    p[0] = q[0]  # the target agrees completely: always accepted
    g = torch.Generator().manual_seed(6)
    counts = torch.zeros(V, dtype=torch.long)
    for _ in range(3000):
        out = rejection_sample(draft, p.log(), q, greedy=False, generator=g)
        assert out[0] == 0 and len(out) == 2
        counts[out[1]] += 1
    assert chi_square(counts, p[1]) < 30.0


def test_sampling_is_deterministic_with_a_seed():
    p, q = distributions(4, 4), distributions(5, 3)
    draft = torch.tensor([0, 1, 2])

    def run(seed: int) -> list[list[int]]:
        g = torch.Generator().manual_seed(seed)
        return [rejection_sample(draft, p.log(), q, greedy=False, generator=g).tolist() for _ in range(30)]

    assert run(42) == run(42)
    assert run(42) != run(43)
