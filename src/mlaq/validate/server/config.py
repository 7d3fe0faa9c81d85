"""What ``mlaq validate --server URL`` runs: the run's shape (shared with local validate), the servers,
the recorded reference, the request settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlaq.validate import defaults as d
from mlaq.validate.server.client import ClientConfig
from mlaq.validate.shape import RunShape

DEFAULT_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class ServerValidateConfig:
    server: ClientConfig  # the candidate (flags on, another precision, ...)
    shape: RunShape = field(
        default_factory=RunShape
    )  # text, windows, prompts, tasks (needs a live reference)
    reference: ClientConfig | None = None  # a second live server (flags off)
    against: Path | None = None  # a recorded reference (--record of an earlier run)
    record: Path | None = None  # write this run's --server measurements here
    model: str | None = None  # served model name of --server (default: its first)
    reference_model: str | None = None
    tokenizer: Path | None = None  # local tokenizer when a server has no /tokenize (preferred if given)
    logprobs: int = DEFAULT_LOGPROBS  # top-k per position; -1: the whole distribution
    concurrency: int = 4
    mc_kl: int = 0  # continuations sampled from the reference for the Monte-Carlo KL (0: none)

    def __post_init__(self) -> None:
        if self.reference is not None and self.against is not None:
            raise ValueError("give --reference URL or --against FILE, not both")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.logprobs == 0 or self.logprobs < -1:
            raise ValueError(
                f"--logprobs must be >= 1 (top-k) or -1 (whole distribution), got {self.logprobs}"
            )
        if self.shape.tasks is not None and self.against is not None:
            raise ValueError(
                "the long-context tasks need a live reference (a recording holds no task answers): "
                "pass --reference URL, or --tasks none with --against"
            )
        if self.mc_kl < 0:
            raise ValueError(f"--mc-kl must be >= 0 continuations, got {self.mc_kl}")
        if self.mc_kl and self.reference is None:
            raise ValueError(
                "--mc-kl samples continuations from the reference: it needs a live --reference URL "
                "(a recording cannot sample)"
            )
        if self.record is not None and self.against is not None and self.record == self.against:
            raise ValueError("--record and --against name the same file")

    def resolve_context(self, max_model_len: int | None) -> int:
        """Window length: teacher forcing asks for one generated token, so T + 1 must fit."""
        limit = None if max_model_len is None else max_model_len - 1
        context_len = self.shape.context_len
        if context_len is None:
            return d.MAX_DEFAULT_CONTEXT if limit is None else min(limit, d.MAX_DEFAULT_CONTEXT)
        if limit is not None and context_len > limit:
            raise ValueError(
                f"--context-len {context_len} does not fit the server's max_model_len {max_model_len} "
                f"(teacher forcing needs one more token); use at most {limit}"
            )
        return context_len
