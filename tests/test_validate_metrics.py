"""The validate measurements as pure functions, against direct or independent computations."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.validate.metrics import (
    Buckets,
    BucketSums,
    divergence,
    first_divergence,
    longest_loop,
    relative_error,
    repeated_ngram_share,
)
from mlaq.validate.theory import THEORY, alignment_gain, excess_kurtosis, theory_for


def test_buckets_cover_the_context_in_equal_parts() -> None:
    b = Buckets(2048, 8)
    assert b.ranges()[0] == (0, 256) and b.ranges()[-1] == (1792, 2048)
    pos = torch.arange(2048)
    idx = b.index(pos)
    assert torch.equal(idx, pos // 256)
    uneven = Buckets(10, 3)  # edges 0, 3, 7, 10
    assert uneven.edges == (0, 3, 7, 10)
    assert uneven.index(torch.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="buckets"):
        Buckets(4, 5)


def test_bucket_sums_match_a_direct_computation() -> None:
    g = torch.Generator().manual_seed(0)
    b = Buckets(40, 4)
    sums = BucketSums(b)
    pos_a, pos_b = torch.arange(40), torch.arange(39)
    va, vb = torch.rand(40, generator=g), torch.rand(39, generator=g)
    for _ in range(2):  # two windows
        sums.add("a", pos_a, va)
        sums.add("b", pos_b, vb)
    per, overall = sums.mean("a")
    assert per == pytest.approx([float(va[i * 10 : (i + 1) * 10].mean()) for i in range(4)])
    assert overall == pytest.approx(float(va.mean()))
    per_b, _ = sums.mean("b")  # its own token counts (39 positions)
    assert per_b[3] == pytest.approx(float(vb[30:39].mean()))
    per_r, overall_r = sums.ratio_rms("a", "b")  # sqrt(sum a / sum b) per bucket
    assert per_r[0] == pytest.approx(math.sqrt(float(va[:10].sum() / vb[:10].sum())))
    assert overall_r == pytest.approx(math.sqrt(float(va.sum() / vb.sum())))


def test_identical_logits_give_exactly_zero_divergence() -> None:
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1)) * 4
    targets = torch.randint(0, 50, (15,))
    d = divergence(torch.log_softmax(logits, -1), logits.clone(), targets)
    assert torch.equal(d.kl, torch.zeros(16, dtype=torch.float64))
    assert torch.equal(d.top1, torch.ones(16, dtype=torch.float64))
    assert torch.equal(d.nll_delta, torch.zeros(15, dtype=torch.float64))


def test_divergence_against_torch_kl_div_and_a_direct_nll() -> None:
    g = torch.Generator().manual_seed(2)
    ref, cand = torch.randn(12, 30, generator=g), torch.randn(12, 30, generator=g)
    targets = torch.randint(0, 30, (11,), generator=g)
    ref_lp = torch.log_softmax(ref, -1)
    d = divergence(ref_lp, cand, targets)
    # torch: kl_div(input=log q, target=log p, log_target) = sum p (log p - log q) = KL(p || q)
    expected = torch.nn.functional.kl_div(
        torch.log_softmax(cand.double(), -1), ref_lp.double(), log_target=True, reduction="none"
    ).sum(-1)
    assert torch.allclose(d.kl, expected, rtol=1e-5, atol=1e-7)
    assert bool((d.kl > 0).all())
    assert d.top1.tolist() == (cand.argmax(-1) == ref.argmax(-1)).double().tolist()
    nll = torch.nn.functional.cross_entropy(cand[:-1].double(), targets, reduction="none")
    nll_ref = torch.nn.functional.cross_entropy(ref[:-1].double(), targets, reduction="none")
    assert torch.allclose(d.nll_delta, nll - nll_ref, atol=1e-5)


def test_relative_error() -> None:
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref + torch.tensor([0.3, 0.4]), ref) == pytest.approx(0.1)
    assert relative_error(ref, ref) == 0.0


def test_repetition_metrics_on_scripted_sequences() -> None:
    assert repeated_ngram_share([1, 2, 3, 4, 5], 2) == 0.0
    assert repeated_ngram_share([1, 2, 1, 2, 1, 2], 2) == pytest.approx(3 / 5)  # (1,2),(2,1) new; 3 repeats
    assert repeated_ngram_share([7, 7], 4) == 0.0  # shorter than n
    assert longest_loop([1, 2, 3, 4, 5, 6]) == 0
    assert longest_loop([5, 1, 2, 1, 2, 1, 2, 9]) == 6  # "1 2" three times
    assert longest_loop([4, 4, 4, 4]) == 4
    assert longest_loop([1, 2, 3, 1, 2, 3, 1, 2, 0]) == 8  # unit of 3, 2 2/3 times
    assert longest_loop([1, 2, 3, 1, 2]) == 0  # the unit is not complete twice


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [0]) == 0


def test_theory_figures() -> None:
    assert THEORY["mxfp4"].product == pytest.approx(0.1583, abs=5e-4)  # W4A4: sqrt(2) x 11.19 %
    assert THEORY["mxfp4_w4a16"].product == pytest.approx(0.1119, abs=2e-4)
    assert THEORY["fp8_per_tensor"].product == pytest.approx(0.037, abs=1e-3)
    assert theory_for("fp8_per_block_fnuz") is THEORY["fp8_per_block"]
    assert (
        theory_for("fp8_per_block_sm90") is THEORY["fp8_per_block"]
        and theory_for("bf16_sm90") is THEORY["bf16"]
    )
    assert theory_for("nvfp4") is None
    assert THEORY["mxfp4"].aligned(4.0) == pytest.approx(math.sqrt(2 * 0.1119**2 / 4 + 0.0017**2))


def test_alignment_gain_and_kurtosis() -> None:
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 256, 128, generator=g), torch.randn(2, 128, 64, generator=g)
    assert alignment_gain(x, w) == pytest.approx(1.0, abs=0.05)  # random signs: the theory's case
    ones_x, ones_w = torch.ones(1, 3, 32), torch.ones(1, 32, 5)
    assert alignment_gain(ones_x, ones_w) == pytest.approx(32.0)  # every product adds up
    assert excess_kurtosis(torch.randn(200_000, generator=g)) == pytest.approx(0.0, abs=0.05)
    heavy = torch.distributions.StudentT(5.0).sample((200_000,))
    assert excess_kurtosis(heavy) > 2.0  # t(5): excess kurtosis 6
