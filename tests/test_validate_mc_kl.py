"""The Monte-Carlo KL estimators against the exact KL of known distributions (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlaq.validate.mc_kl import MIN_SEQUENCES, estimate, exact_kl, per_token


def _dists(vocab: int, seed: int, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=vocab) * 3
    noise = rng.normal(size=vocab) * temperature
    p = np.exp(logits - np.logaddexp.reduce(logits))
    q_logits = logits + noise
    q = np.exp(q_logits - np.logaddexp.reduce(q_logits))
    return p, q


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    return float(np.sum(p * (np.log(p) - np.log(q))))


@pytest.mark.parametrize("spread", [0.3, 1.5])
def test_both_estimators_are_unbiased_and_cover_the_exact_kl(spread) -> None:
    """Tokens drawn from p: k1 and k3 average to KL(p || q); the bootstrap interval holds it."""
    p, q = _dists(200, seed=1, temperature=spread)
    exact = _kl(p, q)
    rng = np.random.default_rng(7)
    draws = [rng.choice(len(p), size=64, p=p) for _ in range(200)]  # 200 continuations of 64 tokens
    ref = [np.log(p[x]) for x in draws]
    cand = [np.log(q[x]) for x in draws]
    est = estimate(ref, cand, seed=3)
    for name in ("k1", "k3"):
        e = est[name]
        assert e.sequences == 200 and e.positions == 200 * 64
        low, high = e.ci
        assert low <= exact <= high, (name, exact, e)
        assert abs(e.kl - exact) < 0.1 * exact + 1e-3, (name, exact, e.kl)
    # k3's spread is the smaller one (the point of it)
    width = {n: est[n].ci[1] - est[n].ci[0] for n in est}
    assert width["k3"] < width["k1"], width


def test_estimators_per_token() -> None:
    lp = np.log(np.array([0.5, 0.25, 0.1]))
    lq = np.log(np.array([0.25, 0.5, 0.1]))
    k1, k3 = per_token(lp, lq)
    r = np.exp(lq - lp)
    assert k1 == pytest.approx(-np.log(r))
    assert k3 == pytest.approx(r - 1 - np.log(r))
    assert (k3 >= 0).all() and k1[1] < 0  # k1 can be negative per token; k3 never is
    assert k1[2] == 0 and k3[2] == 0


def test_identical_servers_estimate_zero() -> None:
    ref = [np.log(np.full(10, 0.3)) for _ in range(MIN_SEQUENCES)]
    est = estimate(ref, [x.copy() for x in ref])
    assert est["k1"].kl == 0 and est["k3"].ci == (0.0, 0.0)


def test_too_few_continuations_give_no_interval() -> None:
    ref = [np.log(np.full(10, 0.3)) for _ in range(MIN_SEQUENCES - 1)]
    cand = [np.log(np.full(10, 0.2)) for _ in ref]
    est = estimate(ref, cand)
    assert est["k1"].ci is None and est["k1"].to_json()["ci"] is None
    assert est["k1"].kl == pytest.approx(math.log(1.5))


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="same continuations"):
        estimate([np.zeros(3)], [])
    with pytest.raises(ValueError, match="infinite"):
        estimate([np.log(np.full(3, 0.5))], [np.array([-1.0, -np.inf, -1.0])])


def test_exact_kl_needs_whole_distributions() -> None:
    p, q = _dists(30, seed=2, temperature=1.0)
    whole_p = {i: math.log(v) for i, v in enumerate(p)}
    whole_q = {i: math.log(v) for i, v in enumerate(q)}
    assert exact_kl([whole_p, whole_p], [whole_q, whole_p]) == pytest.approx(_kl(p, q) / 2)
    top5 = dict(sorted(whole_p.items(), key=lambda kv: -kv[1])[:5])
    assert exact_kl([top5], [whole_q]) is None
