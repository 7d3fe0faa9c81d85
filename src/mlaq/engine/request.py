"""Engine-side state of one request around its ``Sequence``: tokens appended until a stop condition,
and the delta (``RequestOutput``) each step returns, with vLLM's raw logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mlaq.engine.detokenizer import IncrementalDetokenizer
from mlaq.engine.outputs import CompletionOutput, RequestOutput
from mlaq.engine.sequence import FinishReason, check_stop_token
from mlaq.engine.sequence import Sequence as Seq
from mlaq.engine.spec_metrics import SpecDecodingStats


@dataclass(eq=False)
class Request:
    """Engine-side state of one request around its ``Sequence``."""

    seq: Seq
    prompt: str | None
    detok: IncrementalDetokenizer | None
    stats: SpecDecodingStats | None
    pending_hidden: Tensor | None = None  # target hidden states the MTP cache has not seen yet
    cumulative_logprob: float = 0.0
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # sent once, with the first delta
    spec_steps: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step

    def emit(self, tokens: list[int], rows: Tensor, eos_token_ids: Sequence[int], max_model_len: int) -> None:
        """Append tokens (each predicted by the matching row of raw logits) until a stop condition."""
        s, p = self.seq, self.seq.params
        entries = logprob_entries(rows, tokens, p.logprobs) if p.logprobs is not None else None  # raw
        for i, token in enumerate(tokens):
            lp = 0.0
            if entries is not None:
                lp = entries[i][token]
                self.new_logprobs.append(entries[i])
                self.cumulative_logprob += lp
            s.append(token, lp)
            self.new_token_ids.append(token)
            finished = check_stop_token(s, eos_token_ids, max_model_len)
            if self.detok is not None:
                by_token = finished and s.finish_reason is FinishReason.STOP
                early = len(s.output_token_ids) <= p.min_tokens  # vLLM: no stop strings before min_tokens
                if self.detok.add_token(token, skip_text=by_token, check_stop=not early):
                    s.finish(FinishReason.STOP, self.detok.stop_reason)
            if s.is_finished:
                return

    def delta(self, speculative: bool) -> RequestOutput:
        """What this request gained since the last delta (tokens, text, logprobs; the prompt's logprobs
        once), as a ``RequestOutput``; ``speculative``: the engine drafts (spec_steps on the last one)."""
        s = self.seq
        finished = s.is_finished
        want_lp = s.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=self.detok.next_delta(finished) if self.detok else "",
            token_ids=tuple(self.new_token_ids),
            cumulative_logprob=self.cumulative_logprob if want_lp else None,
            logprobs=tuple(self.new_logprobs) if want_lp else None,
            finish_reason=s.finish_reason.value if finished and s.finish_reason else None,
            stop_reason=s.stop_reason,
        )
        self.new_token_ids, self.new_logprobs = [], []
        prompt_lp, self.prompt_logprobs = self.prompt_logprobs, None
        return RequestOutput(
            str(s.seq_id),
            self.prompt,
            tuple(s.prompt_token_ids),
            (completion,),
            finished,
            self.stats,
            prompt_logprobs=tuple(prompt_lp) if prompt_lp is not None else None,
            spec_steps=tuple(self.spec_steps) if finished and speculative else None,
        )


def logprob_entries(rows: Tensor, tokens: Sequence[int], top_n: int | None) -> list[dict[int, float]]:
    """Per row of raw logits (n, V): {token: logprob} of ``tokens[i]`` plus the top ``top_n`` (-1: all).

    vLLM's raw logprobs: log_softmax of the raw logits, before penalties, temperature and truncation."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)  # (n, V)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), dtype=torch.int64)[:, None])[:, 0].tolist()
    n = logprobs.shape[-1] if top_n == -1 else (top_n or 0)
    entries = [{int(t): lp} for t, lp in zip(tokens, chosen, strict=True)]
    if n:
        top = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
        for entry, ids, values in zip(entries, top.indices.tolist(), top.values.tolist(), strict=True):
            for t, v in zip(ids, values, strict=True):
                entry.setdefault(t, v)
    return entries
