"""llama.cpp's KL statistics, the top-k KL estimator, and the spec-decode parsing: pure functions against
independent computations (numpy, hand-computed values)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.validate.kld import format_kld_statistics, kld_statistics, kld_statistics_by_bucket, percentile
from mlaq.validate.server.spec import counter_delta, counters, parse_prometheus, per_request_stats
from mlaq.validate.topk_kl import same_top, topk_kl


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    kl = rng.exponential(0.01, n)
    dp = rng.normal(0, 0.02, n)
    same = (rng.random(n) < 0.9).astype(float)
    nll = rng.normal(0.001, 0.05, n)
    return kl, dp, same, nll


def test_statistics_match_numpy() -> None:
    kl, dp, same, nll = _data(1001)
    s = kld_statistics(kl, dp, same, nll)
    assert s is not None and s["n"] == 1001
    assert s["kld"]["mean"] == pytest.approx(kl.mean(), rel=1e-12)
    # llama.cpp's uncertainty: the population variance over n - 1
    assert s["kld"]["uncertainty"] == pytest.approx(kl.std() / math.sqrt(1000), rel=1e-9)
    for label, f in (("99.9", 0.999), ("99", 0.99), ("95", 0.95), ("90", 0.9), ("10", 0.1), ("0.1", 0.001)):
        assert s["kld"]["quantiles"][label] == pytest.approx(np.quantile(kl, f), rel=1e-12)
    assert s["kld"]["median"] == pytest.approx(np.median(kl)) and s["kld"]["max"] == kl.max()
    assert set(s["delta_p"]["quantiles"]) == {"99.9", "99", "95", "90", "75", "25", "10", "5", "1", "0.1"}
    assert s["delta_p"]["rms"] == pytest.approx(math.sqrt((dp**2).mean()), rel=1e-12)
    p = same.mean()
    assert s["same_top_p"]["standard_error"] == pytest.approx(math.sqrt(p * (1 - p) / 1000))
    assert s["nll_delta"]["mean"] == pytest.approx(nll.mean())


def test_few_values_have_no_uncertainty_and_none_give_none() -> None:
    kl, dp, same, nll = _data(10)
    assert kld_statistics(kl, dp, same, nll)["kld"]["uncertainty"] == 0.0  # type: ignore[index]
    assert kld_statistics(*(a[:0] for a in (kl, dp, same, nll))) is None
    assert percentile(np.array([1.0, 2.0, 3.0, 4.0]), 0.5) == 2.5


def test_buckets_split_by_position() -> None:
    kl, dp, same, nll = _data(40)
    pos = np.arange(40) % 20
    s = kld_statistics_by_bucket(pos, [0, 10, 20, 30], kl, dp, same, nll)
    assert [b["n"] for b in s["buckets"]] == [20, 20, 0]
    assert s["buckets"][0]["kld"]["mean"] == pytest.approx(kl[pos < 10].mean())


def test_summary_lines_follow_llama_cpp() -> None:
    s = kld_statistics(*_data(500))
    lines = format_kld_statistics(s)  # type: ignore[arg-type]
    assert lines[0].startswith("Mean    KLD: ") and " ± " in lines[0]
    assert lines[2].startswith("99.9%   KLD: ") and lines[3].startswith("99.0%   KLD: ")
    assert any(x.startswith(" 0.1%   KLD: ") for x in lines) and any(
        x.startswith("10.0%   Δp: ") for x in lines
    )
    assert lines[-1].startswith("Same top p: ") and lines[-1].endswith(" %")


def _dist(rng: np.random.Generator, v: int, temp: float = 2.0) -> np.ndarray:
    z = temp * rng.standard_normal(v)
    return z - np.log(np.exp(z - z.max()).sum()) - z.max()


def _top(lp: np.ndarray, k: int) -> dict[int, float]:
    return {int(i): float(lp[i]) for i in np.argsort(-lp)[:k]}


@pytest.mark.parametrize("seed", range(5))
def test_topk_kl_is_a_lower_bound_and_exact_with_the_whole_distribution(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p = _dist(rng, 64)
    q = p + 0.5 * rng.standard_normal(64)
    q = q - np.log(np.exp(q).sum())
    exact = float((np.exp(p) * (p - q)).sum())
    for k in (1, 4, 16):
        est = topk_kl(_top(p, k), _top(q, k))
        assert -1e-12 <= est.kl <= exact + 1e-12 and not est.exact and est.mass_outside > 0
    full = topk_kl(_top(p, 64), _top(q, 64))
    assert full.exact and full.kl == pytest.approx(exact, rel=1e-9) and full.mass_outside < 1e-6
    assert topk_kl(_top(p, 5), _top(p, 5)).kl == 0.0


def test_same_top() -> None:
    assert same_top({1: -0.1, 2: -3.0}, {2: -3.0, 1: -0.2})
    assert not same_top({1: -0.1, 2: -3.0}, {2: -0.1, 1: -0.2})


METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="other"} 99.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 2.0
odd_metric{label="a \\"quoted\\" value"} 1e3
"""


def test_prometheus_counters_and_their_delta() -> None:
    samples = parse_prometheus(METRICS)
    assert samples[-1].label("label") == 'a "quoted" value' and samples[-1].value == 1000.0
    before = counters(samples, "m")
    assert before.num_drafts == 10 and before.per_pos == (7, 4, 1) and before.requests == 5
    after = counters(parse_prometheus(METRICS.replace(" 10.0", " 16.0").replace(" 3.0\n", " 6.0\n")), "m")
    d = counter_delta(before, after, ours=3)
    assert d.stats is not None and d.stats.num_drafts == 6 and d.warning is None
    assert counter_delta(before, after, ours=2).warning is not None  # 3 requests finished, 2 were ours


def test_per_request_metrics_match_the_engine_counters() -> None:
    # steps accepting 2, 0, 3, 1 of k=3 drafts, counted by mlaq's own (vLLM-defined) counters
    expected = SpecDecodingStats.new(3)
    for n in (2, 0, 3, 1):
        expected = expected.observe(3, n)
    for hist in ([1, 1, 1, 1], {"0": 1, "1": 1, "2": 1, "3": 1}):
        got = per_request_stats(
            {
                "speculative_decoding": {
                    "num_spec_tokens": 3,
                    "num_spec_steps": 4,
                    "acceptance_histogram": hist,
                }
            }
        )
        assert got == expected
    assert per_request_stats(None) is None and per_request_stats({"speculative_decoding": None}) is None


def test_topk_kl_hand_computed() -> None:
    p, q = np.log([0.5, 0.3, 0.2]), np.log([0.4, 0.35, 0.25])
    est = topk_kl({0: float(p[0])}, {0: float(q[0])})  # S = {0}; the rest cell holds 0.5 vs 0.6
    assert est.kl == pytest.approx(0.5 * math.log(0.5 / 0.4) + 0.5 * math.log(0.5 / 0.6), rel=1e-12)
    assert est.mass_outside == pytest.approx(0.5)
