"""One request's running state: its tokens, how many of them are cached, and why it finished."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

import torch

from mlaq.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(Enum):
    """vLLM's ``finish_reason`` values."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client went away (or the server stopped) before it finished


@dataclass(eq=False)  # mutable on purpose: the engine's per-request state, compared by identity
class Sequence:
    """Prompt + output tokens of one request; ``num_cached`` of them have latents in the KV cache."""

    seq_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_cached: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.seq_id}: the prompt is empty; give at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(int(token_id))
        self.output_logprobs.append(float(logprob))

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason


def check_stop_token(seq: Sequence, eos_token_ids: Seq[int], max_model_len: int) -> bool:
    """After appending a token: finish ``seq`` on EOS / stop token id / max_tokens / max_model_len.

    The order follows vLLM's ``check_stop``: EOS (unless ignore_eos), then stop_token_ids, then the
    length limits; before ``min_tokens`` outputs only the length limits apply. Returns True when the
    sequence finished. Stop strings are the detokenizer's job.
    """
    token = seq.last_token_id
    p = seq.params
    # vLLM: no stop by EOS / stop token before min_tokens (the sampler masks their logits too)
    may_stop = len(seq.output_token_ids) > p.min_tokens
    if may_stop and not p.ignore_eos and token in eos_token_ids:
        seq.finish(FinishReason.STOP, None)
    elif may_stop and token in p.stop_token_ids:
        seq.finish(FinishReason.STOP, token)
    elif (p.max_tokens is not None and len(seq.output_token_ids) >= p.max_tokens) or (
        seq.num_tokens >= max_model_len
    ):
        seq.finish(FinishReason.LENGTH)
    return seq.is_finished
