"""Teacher-forced comparison of two servers' answers on one window, as per-position values (pure)."""

from __future__ import annotations

import numpy as np

from mlaq.validate.metrics import first_divergence
from mlaq.validate.server.protocol import Greedy, TeacherForced
from mlaq.validate.topk_kl import same_top, topk_kl


def window_values(reference: TeacherForced, candidate: TeacherForced) -> dict[str, list[float]]:
    """Per predicted position t (0..T-2): kl (the top-k estimate, see topk_kl), mass_outside, exact
    (1.0 where both distributions were whole), top1, delta_p = p_cand - p_ref and nll_delta = NLL_cand -
    NLL_ref of the actual next token."""
    if reference.tokens != candidate.tokens:
        raise ValueError("reference and candidate scored different token windows")
    kl, outside, exact, top1 = [], [], [], []
    for dr, dc in zip(reference.top, candidate.top, strict=True):
        est = topk_kl(dr, dc)
        kl.append(est.kl)
        outside.append(est.mass_outside)
        exact.append(float(est.exact))
        top1.append(float(same_top(dr, dc)))
    lr, lc = reference.token_logprobs, candidate.token_logprobs
    return {
        "kl": kl,
        "mass_outside": outside,
        "exact": exact,
        "top1": top1,
        "delta_p": (np.exp(lc) - np.exp(lr)).tolist(),
        "nll_delta": (lr - lc).tolist(),
    }


def decode_values(reference: Greedy, candidate: Greedy) -> dict[str, list[float]] | None:
    """The decode path, compared where both generations still share their context: generated positions
    1..f, f = the first differing token (its distribution was still computed on equal prefixes; all of
    them when none differs). Position 0 is left out: its distribution comes from the prefill. None when
    a server returned no id-keyed top logprobs for its completions."""
    if reference.top is None or candidate.top is None:
        return None
    f = first_divergence(reference.tokens, candidate.tokens)
    end = min(len(reference.top), len(candidate.top)) if f is None else f + 1
    kl, outside, exact, top1 = [], [], [], []
    for dr, dc in zip(reference.top[1:end], candidate.top[1:end], strict=True):
        est = topk_kl(dr, dc)
        kl.append(est.kl)
        outside.append(est.mass_outside)
        exact.append(float(est.exact))
        top1.append(float(same_top(dr, dc)))
    return {"kl": kl, "mass_outside": outside, "exact": exact, "top1": top1}
