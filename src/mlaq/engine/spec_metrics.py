"""Speculative-decoding acceptance metrics, defined and printed exactly as vLLM does.

Per verification step of a request with k draft tokens (vLLM ``vllm/v1/spec_decode/metrics.py``):
drafts += 1, draft_tokens += k, accepted += n (the accepted leading draft tokens), and
accepted_per_pos[i] += 1 for every i < n. From those counters:
  mean acceptance length      = 1 + accepted / drafts   (+1: the token the target always yields)
  avg draft acceptance rate   = accepted / draft_tokens
  per-position acceptance[i]  = accepted_per_pos[i] / drafts
The field names are vLLM's ``SpecDecodingStats``; the log line is its ``SpecDecodingLogging``
line; the counters are its Prometheus ``vllm:spec_decode_*`` counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecDecodingStats:
    """Counters of verification steps; immutable, combine with ``observe`` and ``+``."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    @classmethod
    def new(cls, num_spec_tokens: int) -> SpecDecodingStats:
        """Empty counters for k = ``num_spec_tokens`` positions."""
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be at least 1, got {num_spec_tokens}")
        return cls(num_accepted_tokens_per_pos=(0,) * num_spec_tokens)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> SpecDecodingStats:
        """The counters after one more verification step of one request."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"accepted {num_accepted_tokens} of {num_draft_tokens} draft tokens: "
                "need 0 <= accepted <= drafted"
            )
        per_pos = list(self.num_accepted_tokens_per_pos)
        per_pos += [0] * (num_draft_tokens - len(per_pos))
        for i in range(num_accepted_tokens):  # acceptance is of a prefix: positions 0..n-1
            per_pos[i] += 1
        return SpecDecodingStats(
            self.num_drafts + 1,
            self.num_draft_tokens + num_draft_tokens,
            self.num_accepted_tokens + num_accepted_tokens,
            tuple(per_pos),
        )

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """Merge counters of two requests (or two intervals); positions are aligned from 0."""
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        n = max(len(a), len(b))
        a, b = a + (0,) * (n - len(a)), b + (0,) * (n - len(b))
        return SpecDecodingStats(
            self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            tuple(x + y for x, y in zip(a, b, strict=True)),
        )

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (nan before the first draft)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def draft_acceptance_rate(self) -> float:
        """accepted / draft_tokens, a fraction in [0, 1] (nan before the first draft)."""
        if not self.num_draft_tokens:
            return float("nan")
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def per_position_acceptance_rate(self) -> tuple[float, ...]:
        """accepted_per_pos[i] / drafts for each draft position i."""
        if not self.num_drafts:
            return tuple(float("nan") for _ in self.num_accepted_tokens_per_pos)
        return tuple(n / self.num_drafts for n in self.num_accepted_tokens_per_pos)

    def log_line(self, elapsed_s: float = 0.0) -> str:
        """vLLM's ``SpecDecodingLogging`` line; throughputs are per ``elapsed_s`` (0: shown as 0)."""
        drafted = self.num_draft_tokens / elapsed_s if elapsed_s > 0 else 0.0
        accepted = self.num_accepted_tokens / elapsed_s if elapsed_s > 0 else 0.0
        rates = ", ".join(f"{r:.3f}" for r in self.per_position_acceptance_rate)
        return (
            "SpecDecoding metrics: "
            f"Mean acceptance length: {self.mean_acceptance_length:.2f}, "
            f"Accepted throughput: {accepted:.2f} tokens/s, "
            f"Drafted throughput: {drafted:.2f} tokens/s, "
            f"Accepted: {self.num_accepted_tokens} tokens, "
            f"Drafted: {self.num_draft_tokens} tokens, "
            f"Per-position acceptance rate: {rates}, "
            f"Avg Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%"
        )

    def prometheus(self, labels: Mapping[str, str] | None = None) -> str:
        """The four vLLM counters in Prometheus text exposition format (``_total`` samples)."""
        base = dict(labels or {})
        counters = [
            ("num_drafts", "Number of spec decoding drafts.", [({}, self.num_drafts)]),
            ("num_draft_tokens", "Number of draft tokens.", [({}, self.num_draft_tokens)]),
            ("num_accepted_tokens", "Number of accepted tokens.", [({}, self.num_accepted_tokens)]),
            (
                "num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                [({"position": str(i)}, n) for i, n in enumerate(self.num_accepted_tokens_per_pos)],
            ),
        ]
        lines = []
        for short, help_text, samples in counters:
            name = f"vllm:spec_decode_{short}"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
            for extra, value in samples:
                lines.append(f"{name}_total{_labels({**base, **extra})} {float(value)}")
        return "\n".join(lines) + "\n"


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
