"""Request outputs with vLLM's names (``RequestOutput``, ``CompletionOutput``).

A stream yields deltas (vLLM's ``RequestOutputKind.DELTA``): each carries only the new text,
token ids and logprobs, and the cumulative logprob so far. ``fold`` adds deltas up; the
non-streaming ``generate`` returns exactly the folded stream (one code path).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from mlaq.engine.spec_metrics import SpecDecodingStats


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    cumulative_logprob: float | None
    logprobs: tuple[dict[int, float], ...] | None  # per token: chosen + top-N raw logprobs
    finish_reason: str | None = None  # "stop" | "length" once finished
    stop_reason: str | int | None = None  # the stop string / stop token id; None for EOS or length


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    spec_decoding_stats: SpecDecodingStats | None = field(default=None)  # this request's, if speculating
    # per prompt token: None for the first, then {token_id: logprob} of it and the top N (first delta only)
    prompt_logprobs: tuple[dict[int, float] | None, ...] | None = None
    spec_steps: tuple[tuple[int, int], ...] | None = None  # (drafted, accepted) per step, once finished

    @property
    def text(self) -> str:
        """The (first) completion's text."""
        return self.outputs[0].text


def fold(deltas: Iterable[RequestOutput]) -> RequestOutput:
    """Add up the deltas of one request into the full output."""
    total: RequestOutput | None = None
    for delta in deltas:
        if total is None:
            total = delta
            continue
        if delta.request_id != total.request_id:
            raise ValueError(f"cannot fold outputs of {total.request_id!r} and {delta.request_id!r}")
        a, b = total.outputs[0], delta.outputs[0]
        logprobs = None if a.logprobs is None or b.logprobs is None else a.logprobs + b.logprobs
        merged = replace(b, text=a.text + b.text, token_ids=a.token_ids + b.token_ids, logprobs=logprobs)
        total = replace(
            delta, outputs=(merged,), prompt_logprobs=total.prompt_logprobs or delta.prompt_logprobs
        )
    if total is None:
        raise ValueError("no outputs to fold")
    return total
