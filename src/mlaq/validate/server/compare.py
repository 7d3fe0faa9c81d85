"""Teacher-forced comparison of two servers' answers on the same windows, as per-position arrays and the
report's figures (pure functions: no I/O)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from mlaq.validate.kld import kld_statistics_by_bucket
from mlaq.validate.server.protocol import TeacherForced
from mlaq.validate.topk_kl import same_top, topk_kl


@dataclass(frozen=True)
class PerPosition:
    """Every predicted position of every window, flattened (N positions)."""

    positions: np.ndarray  # context position t of the prediction (it has seen t + 1 tokens)
    kl: np.ndarray  # top-k estimate of KL(reference || candidate), nats
    mass_outside: np.ndarray  # reference probability outside the shared top-k set
    exact: np.ndarray  # bool: both distributions were returned whole
    same_top: np.ndarray  # 1.0 where the argmaxes agree
    delta_p: np.ndarray  # p_cand - p_ref of the actual next token
    nll_ref: np.ndarray
    nll_delta: np.ndarray  # NLL_cand - NLL_ref of the actual next token


def per_position(reference: Sequence[TeacherForced], candidate: Sequence[TeacherForced]) -> PerPosition:
    cols: dict[str, list[float]] = {k: [] for k in ("t", "kl", "out", "exact", "same")}
    for r, c in zip(reference, candidate, strict=True):
        if r.tokens != c.tokens:
            raise ValueError("reference and candidate scored different token windows")
        for t, (dr, dc) in enumerate(zip(r.top, c.top, strict=True)):
            est = topk_kl(dr, dc)
            cols["t"].append(t)
            cols["kl"].append(est.kl)
            cols["out"].append(est.mass_outside)
            cols["exact"].append(est.exact)
            cols["same"].append(float(same_top(dr, dc)))
    lr = np.concatenate([r.token_logprobs for r in reference]) if reference else np.zeros(0)
    lc = np.concatenate([c.token_logprobs for c in candidate]) if candidate else np.zeros(0)
    return PerPosition(
        np.array(cols["t"], dtype=np.int64),
        np.array(cols["kl"]),
        np.array(cols["out"]),
        np.array(cols["exact"], dtype=bool),
        np.array(cols["same"]),
        np.exp(lc) - np.exp(lr),
        -lr,
        lr - lc,
    )


def _by_bucket(values: np.ndarray, positions: np.ndarray, edges: Sequence[int]) -> list[float | None]:
    out: list[float | None] = []
    for lo, hi in pairwise(edges):
        m = (positions >= lo) & (positions < hi)
        out.append(float(values[m].mean()) if m.any() else None)
    return out


def teacher_forced_json(pp: PerPosition, edges: Sequence[int], k: int) -> dict[str, Any]:
    """The candidate's teacher-forced figures, with the report's key names (as local validate's)."""
    out: dict[str, Any] = {}
    for key, values in (("kl", pp.kl), ("top1_agreement", pp.same_top), ("nll_delta", pp.nll_delta)):
        out[key] = float(values.mean())
        out[f"{key}_by_bucket"] = _by_bucket(values, pp.positions, edges)
    out["kl_estimator"] = {
        "logprobs": k,
        "exact": bool(pp.exact.all()),
        "exact_share": float(pp.exact.mean()),
        "mass_outside_mean": float(pp.mass_outside.mean()),
        "mass_outside_max": float(pp.mass_outside.max()),
        "mass_outside_by_bucket": _by_bucket(pp.mass_outside, pp.positions, edges),
        "note": "KL of both distributions coarse-grained onto the tokens known on both sides plus one "
        "'rest' cell: a lower bound of the true KL (data-processing inequality), exact when both "
        "servers return the whole distribution; the gap lives only on mass_outside",
    }
    out["kld_stats"] = kld_statistics_by_bucket(
        pp.positions, edges, pp.kl, pp.delta_p, pp.same_top, pp.nll_delta
    )
    return out


def nll_json(windows: Sequence[TeacherForced], edges: Sequence[int]) -> dict[str, Any]:
    """Mean NLL of the next token, overall and by bucket (the reference's own figure)."""
    nll = -np.concatenate([w.token_logprobs for w in windows])
    pos = np.concatenate([np.arange(len(w.token_logprobs)) for w in windows])
    return {"nll": float(nll.mean()), "nll_by_bucket": _by_bucket(nll, pos, edges)}
