"""Logit adjustments that need a request's history or settings: min_tokens, logit_bias and vLLM's three
penalties, in vLLM v1's order (``Sampler.apply_logits_processors``):

1. min_tokens: before ``min_tokens`` outputs, EOS and the stop token ids get -inf;
2. logit_bias: ``logits[t] += bias[t]``;
3. repetition: a token seen in the prompt OR the output is divided by the penalty when its logit is
   positive, multiplied by it otherwise (vLLM's CUDA kernel divides; its CPU fallback multiplies by
   ``1 / penalty``, which can differ by an ulp);
4. frequency: ``logits -= frequency_penalty * count`` (count in the OUTPUT only, OpenAI's definition);
5. presence: ``logits -= presence_penalty * (count > 0)`` (OUTPUT only).

All in float32, as vLLM does after ``logits.to(float32)``; steps 4 and 5 run over the whole row
(``x - 0`` leaves a logit unchanged). Applied to the logits a request samples from (and that
speculative verification compares against), never to the logprobs it returns: those stay vLLM's
default raw logprobs. Row i of a block of rows predicts output token ``len(output) + i`` after the
sequence plus the first i draft tokens, so the drafts count as output tokens: a verification step
sees exactly the history plain decoding would have seen.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.sequence import Sequence as Seq


def apply_penalties(
    x: Tensor,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    eos_token_ids: Sequence[int] = (),
) -> Tensor:
    """One float32 (V,) row of logits after ``params``' min_tokens, logit_bias and penalties, given
    the ``prompt`` and the ``output`` so far (which decides min_tokens and the penalties)."""
    x = x.float().clone()  # (V,)
    vocab = x.shape[0]
    p = params
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    if len(output) < p.min_tokens and stops:
        x[torch.tensor(sorted(t for t in stops if t < vocab), dtype=torch.int64)] = float("-inf")
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64)
        x[ids] += torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor([*prompt, *output], dtype=torch.int64)] = True
        penalty = torch.tensor(p.repetition_penalty, dtype=torch.float32)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab)[:vocab]  # (V,)
        x -= torch.tensor(p.frequency_penalty, dtype=torch.float32) * counts
        x -= torch.tensor(p.presence_penalty, dtype=torch.float32) * (counts > 0)
    return x


def adjusted_logits(
    rows: Tensor, seq: Seq, eos_token_ids: Sequence[int], drafts: Sequence[int] = ()
) -> Tensor:
    """(n, V) logits of ``seq``'s next n positions -> float32 (n, V) with its adjustments applied."""
    if not seq.params.penalized:
        return rows
    return torch.stack(
        [
            apply_penalties(
                rows[i], seq.params, seq.prompt_token_ids, [*seq.output_token_ids, *drafts[:i]], eos_token_ids
            )
            for i in range(rows.shape[0])
        ]
    )
