"""MTP drafting for speculative decoding (``LLMEngine`` with a ``speculative_config``): the drafts
of step 1 of the engine's loop (mlaq.engine.engine), chained as vLLM's MTP proposer chains them."""

from __future__ import annotations

import torch

from mlaq.engine.request import Request
from mlaq.engine.runner import ModelRunner
from mlaq.engine.sequence import Sequence as Seq


def propose(runner: ModelRunner, reqs: list[Request], k: int, max_model_len: int) -> list[list[int]]:
    """``k`` greedy MTP drafts per request; fewer near max_model_len and near max_tokens, as vLLM's
    scheduler caps a step at prompt + max_tokens - 1 computed tokens: a step then emits at most the
    tokens the request may still emit, so accepted drafts never exceed emitted tokens."""
    drafts: list[list[int]] = [[] for _ in reqs]
    ks = [min(k, max_model_len - r.seq.num_tokens, _room(r.seq) - 1) for r in reqs]
    active = [i for i, n in enumerate(ks) if n > 0 and reqs[i].pending_hidden is not None]
    if not active:
        return drafts
    seqs = [reqs[i].seq for i in active]
    hidden = [reqs[i].pending_hidden for i in active]
    starts = [s.num_cached - h.shape[0] for s, h in zip(seqs, hidden, strict=True)]
    tokens = [s.all_token_ids[st + 1 : s.num_cached + 1] for s, st in zip(seqs, starts, strict=True)]
    out = runner.mtp(seqs, tokens, hidden, starts, last_only=True)
    last = torch.tensor([len(t) - 1 for t in tokens])
    rows = torch.arange(len(active))
    logits, h = out.logits[:, -1], out.hidden[rows, last]  # (A, V), (A, H): each row's last token
    for i in active:
        reqs[i].pending_hidden = None  # the MTP cache has seen them now
    for j in range(k):
        for a, token in enumerate(logits.argmax(dim=-1).tolist()):
            drafts[active[a]].append(token)  # MTP drafts greedily, as vLLM's proposer
        # Chain: the MTP layer at position N-1+j reads its own hidden state and draft j+1.
        chain = [a for a, i in enumerate(active) if ks[i] > j + 1]
        if not chain:
            break
        out = runner.mtp(
            [seqs[a] for a in chain],
            [[drafts[active[a]][-1]] for a in chain],
            [h[a : a + 1] for a in chain],
            [seqs[a].num_cached + j for a in chain],
        )
        active = [active[a] for a in chain]
        seqs = [seqs[a] for a in chain]
        logits, h = out.logits[:, 0], out.hidden[:, 0]
    return drafts


def _room(seq: Seq) -> int:
    """Output tokens ``seq`` may still emit under max_tokens (a large number without a limit)."""
    limit = seq.params.max_tokens
    return 1 << 30 if limit is None else limit - len(seq.output_token_ids)
