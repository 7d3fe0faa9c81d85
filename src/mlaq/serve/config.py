"""The server's settings (``mlaq serve``'s flags, vLLM's names), frozen."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class SpecMetricsMode(Enum):
    """vLLM's ``--per-request-spec-decode-metrics``: what ``metrics.speculative_decoding`` holds."""

    NONE = "none"
    SUMMARY = "summary"  # counts, rates, the acceptance histogram
    DETAILED = "detailed"  # also per_step_accepted / per_step_drafted


@dataclass(frozen=True)
class ServeConfig:
    """What the HTTP layer needs; the engine's own settings go to ``mlaq.LLM``."""

    served_model_name: str
    model_path: str
    max_model_len: int
    api_key: str | None = None
    max_waiting: int = 256  # waiting requests beyond this get 503
    max_body_bytes: int = 8 * 1024 * 1024  # request bodies beyond this get 413
    max_logprobs: int = 20  # vLLM's --max-logprobs; -1 allows logprobs=-1 (the whole vocabulary)
    spec_metrics: SpecMetricsMode = SpecMetricsMode.NONE
    return_tokens_as_token_ids: bool = False  # vLLM's flag: logprob tokens as "token_id:N"

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        if self.max_logprobs < -1:
            raise ValueError(f"--max-logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}")
