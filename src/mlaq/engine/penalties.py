"""Logit adjustments that need a request's history: vLLM's repetition penalty and min_tokens.

Applied to the logits a request samples from (and that speculative verification compares against),
never to the logprobs it returns: those stay vLLM's default raw logprobs. Row i of a block of rows
predicts output token ``len(output) + i`` after the sequence plus the first i draft tokens, so a
verification step sees exactly the history plain decoding would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.engine.sequence import Sequence as Seq


def adjusted_logits(
    rows: Tensor, seq: Seq, eos_token_ids: Sequence[int], drafts: Sequence[int] = ()
) -> Tensor:
    """(n, V) logits of ``seq``'s next n positions -> float32 (n, V) with its penalties applied."""
    p = seq.params
    if not p.penalized:
        return rows
    x = rows.float().clone()  # (n, V)
    history = seq.all_token_ids
    if p.repetition_penalty != 1.0:
        for i in range(x.shape[0]):
            seen = torch.tensor(sorted(set(history) | set(drafts[:i])), dtype=torch.int64)
            # vLLM: a seen token's logit is divided by the penalty when positive, multiplied when not
            row = x[i, seen]
            x[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    if p.min_tokens and stops:
        early = [i for i in range(x.shape[0]) if len(seq.output_token_ids) + i < p.min_tokens]
        if early:
            ids = torch.tensor(sorted(t for t in stops if t < x.shape[1]), dtype=torch.int64)
            x[torch.tensor(early)[:, None], ids[None, :]] = float("-inf")
    return x
