"""The measurements as pure functions: position buckets, teacher-forced divergences, repetition.

Definitions (the report repeats them):
- relative error of an output y against the reference r over a set of tokens: sqrt(sum |y - r|^2 /
  sum |r|^2) (RMS error over RMS value, so a bucket's figure is not an average of ratios);
- KL(reference || candidate) per position: sum_v p_ref(v) (log p_ref(v) - log p_cand(v)), in nats;
- top-1 agreement: argmax equal; NLL change: NLL_cand(next token) - NLL_ref(next token), in nats;
- repeated n-gram share: of the generated text's n-grams, the share that occurred earlier in it;
- longest loop: the longest stretch of generated tokens that repeats a unit of p tokens at least
  twice in a row (tokens[i] == tokens[i - p] all through), for any period p; 0 if none;
- first divergence: the index of the first generated token that differs from the reference's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Buckets:
    """``count`` equal-width buckets of positions 0..context_len-1."""

    context_len: int
    count: int

    def __post_init__(self) -> None:
        if not 1 <= self.count <= self.context_len:
            raise ValueError(
                f"buckets must be between 1 and the context ({self.context_len}), got {self.count}"
            )

    @property
    def edges(self) -> tuple[int, ...]:
        return tuple(round(i * self.context_len / self.count) for i in range(self.count + 1))

    def ranges(self) -> list[tuple[int, int]]:
        """[start, end) of each bucket."""
        e = self.edges
        return [(e[i], e[i + 1]) for i in range(self.count)]

    def index(self, positions: Tensor) -> Tensor:
        """Bucket of each position (int64, same shape)."""
        edges = torch.tensor(self.edges[1:-1], dtype=torch.int64)
        return torch.bucketize(positions.to(torch.int64), edges, right=True)


class BucketSums:
    """Float64 sums of per-position quantities by bucket (each quantity with its own token count)."""

    def __init__(self, buckets: Buckets) -> None:
        self.buckets = buckets
        self.sums: dict[str, Tensor] = {}
        self.counts: dict[str, Tensor] = {}

    def add(self, name: str, positions: Tensor, values: Tensor) -> None:
        """Add ``values`` (one per position, same shape as ``positions``) to quantity ``name``."""
        n = self.buckets.count
        idx = self.buckets.index(positions.reshape(-1))
        self.sums.setdefault(name, torch.zeros(n, dtype=torch.float64))
        self.counts.setdefault(name, torch.zeros(n, dtype=torch.float64))
        self.sums[name].index_add_(0, idx, values.reshape(-1).double())
        self.counts[name].index_add_(0, idx, torch.ones(idx.shape, dtype=torch.float64))

    def mean(self, name: str) -> tuple[list[float | None], float]:
        """Per-bucket means (None for an empty bucket) and the mean over every token."""
        s, c = self.sums[name], self.counts[name]
        per = [float(a / b) if b else None for a, b in zip(s, c, strict=True)]
        return per, float(s.sum() / c.sum())

    def ratio_rms(self, num: str, den: str) -> tuple[list[float | None], float]:
        """sqrt(sum num / sum den) by bucket and overall: the relative RMS error."""
        a, b = self.sums[num], self.sums[den]
        per = [math.sqrt(float(x / y)) if y else None for x, y in zip(a, b, strict=True)]
        return per, math.sqrt(float(a.sum() / b.sum()))


def relative_error_terms(out: Tensor, ref: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token |out - ref|^2 and |ref|^2 (float64) for (..., T, D) outputs: sum over D."""
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64) ** 2).sum(-1), (ref64**2).sum(-1)


def relative_error(out: Tensor, ref: Tensor) -> float:
    """sqrt(sum |out - ref|^2 / sum |ref|^2) over the whole tensor (each sum one full reduction)."""
    out64, ref64 = out.contiguous().double(), ref.contiguous().double()
    return math.sqrt(float(((out64 - ref64) ** 2).sum() / (ref64**2).sum()))


@dataclass(frozen=True)
class PositionDivergence:
    """Teacher-forced comparison of one window, per position (T positions; NLL at T - 1)."""

    kl: Tensor  # (T,) float64, nats
    top1: Tensor  # (T,) float64, 1.0 where the argmaxes agree
    nll_ref: Tensor  # (T-1,) float64
    nll_delta: Tensor  # (T-1,) float64: candidate minus reference


_KL_ROWS = 64  # rows of a (T, V) window whose float64 KL terms are formed at once (2 MB at V = 4,096)


def divergence(ref_logprobs: Tensor, logits: Tensor, targets: Tensor) -> PositionDivergence:
    """ref_logprobs (T, V) log-softmax of the reference, logits (T, V) of the candidate, targets (T-1,)
    the next tokens. Identical logits give exactly zero KL and NLL change (the differences are 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # (T, V)
    p_ref = ref_logprobs.exp()
    delta = ref_logprobs - lp
    kl = torch.empty(lp.shape[0], dtype=torch.float64)  # (T,): the fp32 x fp32 products are exact in float64;
    for i in range(0, lp.shape[0], _KL_ROWS):  # rows a few at a time: float64 copies that stay in cache
        kl[i : i + _KL_ROWS] = (p_ref[i : i + _KL_ROWS].double() * delta[i : i + _KL_ROWS].double()).sum(-1)
    top1 = (lp.argmax(-1) == ref_logprobs.argmax(-1)).double()
    idx = targets.long()[:, None]  # (T-1, 1)
    nll_ref = -ref_logprobs[:-1].gather(1, idx)[:, 0].double()
    nll = -lp[:-1].gather(1, idx)[:, 0].double()
    return PositionDivergence(kl, top1, nll_ref, nll - nll_ref)


def repeated_ngram_share(tokens: Sequence[int], n: int) -> float:
    """Share of the n-grams of ``tokens`` that already occurred earlier in ``tokens`` (0 if none)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


def longest_loop(tokens: Sequence[int]) -> int:
    """Tokens in the longest stretch made of one unit repeated at least twice in a row (0 if none)."""
    best = 0
    for period in range(1, len(tokens) // 2 + 1):
        run = 0  # consecutive i with tokens[i] == tokens[i - period]
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run >= period:  # the unit has been seen twice: the stretch spans run + period tokens
                best = max(best, run + period)
    return best


def first_divergence(reference: Sequence[int], candidate: Sequence[int]) -> int | None:
    """Index of the first differing token; None when one sequence is a prefix of the other."""
    for i, (a, b) in enumerate(zip(reference, candidate, strict=False)):
        if a != b:
            return i
    return None
