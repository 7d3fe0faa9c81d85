"""Speculative decoding's accept/reject step (Leviathan et al. 2023; Chen et al. 2023; vLLM).

A draft proposes k tokens x_1..x_k; one target forward pass over the k+1 positions gives the
target distributions p_1..p_{k+1}. This step keeps a prefix of the draft and adds one target
token, so every verification step yields between 1 and k+1 tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mlaq.engine.sampler import draw


def rejection_sample(
    draft_token_ids: Tensor,
    target_logits: Tensor,
    draft_probs: Tensor | None = None,
    *,
    greedy: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Tokens to emit for one request: the accepted draft prefix, then one token from the target.

    draft_token_ids (k,): the proposal. target_logits (k+1, V): the target's logits at the k+1
    positions, already processed for the request (``sampler.processed_logits``: temperature,
    top-k/p, min-p), so softmax(target_logits) is the distribution to reproduce.
    draft_probs (k, V): the draft distributions q_i; None means the draft took its argmax (MTP
    drafts greedily, as in vLLM), i.e. q_i is one-hot on x_i. Returns (n+1,) int64, n = accepted.
    """
    k = draft_token_ids.shape[0]
    if target_logits.shape[0] != k + 1:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows for {k} draft tokens; need k+1")
    if greedy:
        # Greedy: the target's own choice at each position is argmax p_i. Accept x_i while it equals
        # that choice; at the first mismatch emit the target's choice instead (the token plain greedy
        # decoding would have produced there); if all k match, the argmax at k+1 is the bonus token.
        # Output is therefore identical, token for token, to plain greedy decoding.
        target_ids = target_logits.argmax(dim=-1)  # (k+1,)
        n = int((draft_token_ids == target_ids[:k]).long().cumprod(0).sum())  # leading matches
        return target_ids[: n + 1].clone()

    p = torch.softmax(target_logits.float(), dim=-1)  # (k+1, V)
    if draft_probs is None:
        q = torch.zeros_like(p[:k]).scatter_(1, draft_token_ids[:, None], 1.0)  # (k, V) one-hot
    else:
        q = draft_probs.float()
    out: list[int] = []
    for i in range(k):
        x = int(draft_token_ids[i])
        # Accept x with probability min(1, p(x)/q(x)): then P(emit x and accept) = min(q(x), p(x)).
        u = float(torch.rand((), generator=generator))
        if q[i, x] > 0 and p[i, x] >= u * q[i, x]:
            out.append(x)
            continue
        # Rejected, which happens with total probability sum_y max(0, q(y) - p(y)). Draw from the
        # residual r = norm(max(0, p - q)): min(q, p) + (1 - sum min(q, p)) r = p, so the emitted
        # token is distributed exactly as p. (r is never all zero here: that would need p = q,
        # where rejection has probability 0; fall back to p for rounding's sake.)
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        out.append(draw(residual, generator))
        return torch.tensor(out, dtype=torch.int64)
    # All k accepted: the target's distribution at position k+1 is free, sample the bonus token.
    out.append(draw(p[k], generator))
    return torch.tensor(out, dtype=torch.int64)
