"""KL(reference || candidate) from the top-k log-probabilities two servers return, with its bound.

A server returns, per position, the log-probabilities of its k most likely tokens (plus the actual
next token's). Let S be the tokens whose log-probability is known on BOTH sides (the intersection of
the two top-k sets, plus the actual token). The estimator is the KL of the two distributions
coarse-grained onto the partition {each token of S} + {everything else}:

    KL_hat = sum_{v in S} p(v) log(p(v) / q(v)) + p_rest log(p_rest / q_rest),
    p_rest = 1 - sum_{v in S} p(v),  q_rest = 1 - sum_{v in S} q(v).

Bound: merging outcomes never increases KL (the data-processing inequality), so 0 <= KL_hat <= KL,
and the whole gap lives on the mass outside S: KL - KL_hat = p_rest * KL(p | rest || q | rest). The
report therefore carries p_rest ("mass outside the top-k sets", S being inside the union of the two
top-k sets, so this is at least the mass outside that union): where it is small the estimate is
tight; where both sides return the full distribution, S is the vocabulary, p_rest = 0 and
KL_hat = KL exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# Below this, leftover mass is float rounding of a distribution that was returned whole.
_EXACT_MASS = 1e-6
_TINY = 1e-300


@dataclass(frozen=True)
class TopkKL:
    kl: float  # the estimate, nats (a lower bound of the true KL; equal when exact)
    mass_outside: float  # p_rest: the reference's probability outside S
    exact: bool  # S covered both distributions (to float rounding)


def topk_kl(reference: Mapping[int, float], candidate: Mapping[int, float]) -> TopkKL:
    """KL_hat from two {token id: log-probability} maps of one position (see the module docstring)."""
    shared = reference.keys() & candidate.keys()
    kl = 0.0
    p_in = q_in = 0.0
    for v in shared:
        lp, lq = reference[v], candidate[v]
        p = math.exp(lp)
        p_in += p
        q_in += math.exp(lq)
        if p > 0:
            kl += p * (lp - lq)
    p_rest, q_rest = max(0.0, 1.0 - p_in), max(0.0, 1.0 - q_in)
    exact = p_rest < _EXACT_MASS and q_rest < _EXACT_MASS
    if not exact and p_rest > 0:
        kl += p_rest * math.log(p_rest / max(q_rest, _TINY))
    return TopkKL(kl, p_rest, exact)


def same_top(reference: Mapping[int, float], candidate: Mapping[int, float]) -> bool:
    """Whether the two argmaxes agree (ties broken by the lower token id on both sides)."""
    return _argmax(reference) == _argmax(candidate)


def _argmax(d: Mapping[int, float]) -> int:
    return min(d, key=lambda v: (-d[v], v))


def estimator_summary(mass_outside: list[list[float]], exact: list[list[float]]) -> dict[str, object]:
    """The bound's figures over every position (per window lists, as the record keeps them)."""
    flat = [x for w in mass_outside for x in w]
    ex = [x for w in exact for x in w]
    return {
        "exact": all(ex),
        "exact_share": sum(ex) / len(ex),
        "mass_outside_mean": sum(flat) / len(flat),
        "mass_outside_max": max(flat),
        "note": "KL of both distributions coarse-grained onto the tokens known on both sides plus one "
        "'rest' cell: a lower bound of the true KL (data-processing inequality), exact when both servers "
        "return the whole distribution; the gap lives only on the reference's mass outside that set",
    }


def logprobs_label(k: int) -> str:
    """What a server was asked for: ``top-20`` or, for ``--logprobs -1``, the whole vocabulary."""
    return "full-vocabulary" if k < 0 else f"top-{k}"


def estimate_words(est: dict[str, object], k: int) -> str:
    """How a KL figure was obtained, for the report: "exact" only when every position's distributions
    were whole; otherwise a lower bound, with the share of positions that were exact."""
    if est.get("exact"):
        return "exact (whole distributions at every position)"
    share = float(est.get("exact_share") or 0.0)  # type: ignore[arg-type]
    where = f", exact at {100 * share:.1f} % of positions" if share > 0 else ""
    return f"{logprobs_label(k)} estimate, a lower bound{where}"
