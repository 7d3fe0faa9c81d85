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
    """Add up the deltas of one request into the full output: the last delta's fields, with the text,
    token ids and logprobs of all of them (joined once: linear in the output's length) and the prompt's
    logprobs of the first delta that has them."""
    first: RequestOutput | None = None
    last: RequestOutput | None = None
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] | None = []
    prompt_logprobs = None
    for delta in deltas:
        if first is None:
            first = delta
        elif delta.request_id != first.request_id:
            raise ValueError(f"cannot fold outputs of {first.request_id!r} and {delta.request_id!r}")
        out = delta.outputs[0]
        texts.append(out.text)
        token_ids.extend(out.token_ids)
        if logprobs is not None and out.logprobs is not None:
            logprobs.extend(out.logprobs)
        else:
            logprobs = None  # a delta without logprobs: none for the whole output (as before)
        prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
        last = delta
    if last is None:
        raise ValueError("no outputs to fold")
    merged = replace(
        last.outputs[0],
        text="".join(texts),
        token_ids=tuple(token_ids),
        logprobs=None if logprobs is None else tuple(logprobs),
    )
    return replace(last, outputs=(merged,), prompt_logprobs=prompt_logprobs)
