"""The sampler: logits of a batch -> one token per row, in vLLM's order of operations.

Order (vLLM v1 ``Sampler``): greedy rows take the argmax of the raw logits; the others get
temperature, then min-p, then top-k, then top-p, then a draw from the remaining distribution.
The draw is the exponential race vLLM uses, ``argmax(probs / q)`` with ``q ~ Exp(1)`` per token,
which picks token i with probability probs[i]; ``q`` comes from the request's own
``torch.Generator``, so a seeded request gets the same tokens whatever else is in the batch.

Logprobs follow vLLM's default ``logprobs_mode="raw_logprobs"``: ``log_softmax`` of the RAW
logits (before temperature and truncation), for the chosen token and for the top N.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerOutput:
    """What the sampler chose for a batch of B rows."""

    token_ids: Tensor  # (B,) int64
    logprobs: Tensor | None  # (B,) float32, raw logprob of each chosen token (None: not asked)
    top_token_ids: Tensor | None  # (B, N) int64, N = largest `logprobs` asked in the batch
    top_logprobs: Tensor | None  # (B, N) float32


def processed_logits(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """(B, V) logits -> float32 (B, V) with temperature applied and truncated tokens set to -inf.

    Greedy rows are returned unscaled (temperature 1) and untruncated; their argmax is unchanged.
    ``softmax`` of the result is the distribution a sampled row draws from (and the target
    distribution speculative decoding must reproduce).
    """
    _check_batch(logits, params)
    x = logits.float()  # (B, V)
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params])  # (B,)
    x = x / temperature[:, None]

    min_p = torch.tensor([p.min_p for p in params])  # (B,)
    if bool((min_p > 0).any()):
        # min-p: drop tokens less likely than min_p times the most likely one (after temperature).
        probs = torch.softmax(x, dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # (B, 1)
        x = x.masked_fill(probs < threshold, float("-inf"))

    vocab = x.shape[-1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else 0 for p in params])  # (B,) 0 = off
    top_p = torch.tensor([p.top_p for p in params])  # (B,)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        x = _top_k_top_p(x, top_k, top_p)
    return x


def _top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    sorted_x, order = x.sort(dim=-1, descending=True)  # (B, V) each
    # top-k by value, as vLLM does: ties with the k-th largest logit are kept.
    kth = sorted_x.gather(1, (top_k - 1).clamp(min=0)[:, None])  # (B, 1)
    drop_k = (sorted_x < kth) & (top_k > 0)[:, None]
    sorted_x = sorted_x.masked_fill(drop_k, float("-inf"))
    # top-p: keep the smallest head whose mass reaches p, i.e. drop a token once the mass strictly
    # before it is already >= p. Rows with p = 1 are left alone: a rounded cumsum can reach 1.0
    # before the tail and would otherwise cut tokens of tiny but nonzero probability.
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V), exclusive cumulative sum
    drop_p = (mass_before >= top_p[:, None]) & (top_p < 1)[:, None]
    drop_p[:, 0] = False  # the most likely token always survives
    sorted_x = sorted_x.masked_fill(drop_p, float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_x)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from a (V,) distribution: the exponential race ``argmax(probs / q)``, q ~ Exp(1).

    P(argmax = i) = probs[i] (the first arrival of independent exponential clocks with rates
    probs[i]). Zero-probability tokens can never win. ``generator=None`` uses torch's global RNG.
    """
    q = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=generator)  # (V,)
    return int((probs.float() / q).argmax())


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    logprobs: bool = True,
) -> SamplerOutput:
    """Choose one token per row of ``logits`` (B, V) under each row's ``SamplingParams``.

    ``generators[i]`` is row i's own RNG (None: torch's global RNG); greedy rows draw nothing.
    ``logprobs=False``: no log_softmax over the vocabulary (the engine's decode loop computes
    logprobs only for requests that ask); the chosen tokens are the same.
    """
    if len(generators) != len(params):
        raise ValueError(f"got {len(generators)} generators for {len(params)} rows; pass one per row")
    raw = logits.float()  # (B, V)
    chosen = raw.argmax(dim=-1)  # (B,) greedy rows keep this
    if not all(p.greedy for p in params):  # an all-greedy batch needs no processed distribution
        probs = torch.softmax(processed_logits(raw, params), dim=-1)  # (B, V)
        for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
            if not p.greedy:
                chosen[row] = draw(probs[row], gen)
    else:
        _check_batch(raw, params)

    if not logprobs:
        return SamplerOutput(chosen, None, None, None)
    lp = torch.log_softmax(raw, dim=-1)  # raw_logprobs, vLLM's default
    chosen_logprobs = lp.gather(1, chosen[:, None])[:, 0]  # (B,)
    n_top = max((p.logprobs or 0 for p in params), default=0)
    top_ids = top_lp = None
    if n_top > 0:
        top_lp, top_ids = lp.topk(min(n_top, lp.shape[-1]), dim=-1)  # (B, N) each
    return SamplerOutput(chosen, chosen_logprobs, top_ids, top_lp)


def _check_batch(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(params):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not fit {len(params)} requests; expected (B, V)"
        )
