"""What ``mlaq validate --server URL`` runs: the servers, the recorded reference, the sizes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlaq.validate import defaults as d
from mlaq.validate.server.client import ClientConfig
from mlaq.validate.tasks.spec import TaskConfig

DEFAULT_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(frozen=True)
class ServerValidateConfig:
    server: ClientConfig  # the candidate (flags on, another precision, ...)
    reference: ClientConfig | None = None  # a second live server (flags off)
    against: Path | None = None  # a recorded reference (--record of an earlier run)
    record: Path | None = None  # write this run's --server measurements here
    model: str | None = None  # served model name of --server (default: its first)
    reference_model: str | None = None
    tokenizer: Path | None = None  # local tokenizer when a server has no /tokenize (preferred if given)
    eval_text: Path | None = None  # None: the bundled model's held-out text
    context_len: int | None = None  # None: min(max_model_len - 1, d.MAX_DEFAULT_CONTEXT)
    windows: int = d.WINDOWS
    buckets: int = d.BUCKETS
    prompts: int = d.PROMPTS
    prompt_len: int = d.PROMPT_LEN
    max_tokens: int = d.MAX_TOKENS
    logprobs: int = DEFAULT_LOGPROBS  # top-k per position; -1: the whole distribution
    concurrency: int = 4
    ngram: int = d.NGRAM
    seed: int = 0
    tasks: TaskConfig | None = None  # the long-context task suite (needs a live reference or none)
    mc_kl: int = 0  # continuations sampled from the reference for the Monte-Carlo KL (0: none)

    def __post_init__(self) -> None:
        if self.reference is not None and self.against is not None:
            raise ValueError("give --reference URL or --against FILE, not both")
        positive = {
            "--windows": self.windows,
            "--buckets": self.buckets,
            "--prompts": self.prompts,
            "--prompt-len": self.prompt_len,
            "--max-tokens": self.max_tokens,
            "--concurrency": self.concurrency,
            "--ngram": self.ngram,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.logprobs == 0 or self.logprobs < -1:
            raise ValueError(
                f"--logprobs must be >= 1 (top-k) or -1 (whole distribution), got {self.logprobs}"
            )
        if self.context_len is not None and self.context_len < 2:
            raise ValueError(f"--context-len must be at least 2 tokens, got {self.context_len}")
        if self.tasks is not None and self.against is not None:
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
        if self.context_len is None:
            return d.MAX_DEFAULT_CONTEXT if limit is None else min(limit, d.MAX_DEFAULT_CONTEXT)
        if limit is not None and self.context_len > limit:
            raise ValueError(
                f"--context-len {self.context_len} does not fit the server's max_model_len {max_model_len} "
                f"(teacher forcing needs one more token); use at most {limit}"
            )
        return self.context_len
