"""MTP / speculative-decoding acceptance of a live server: /metrics counter deltas or per-request metrics.

Two sources, in order of preference:
1. per-request: vLLM's ``--per-request-spec-decode-metrics summary|detailed`` adds
   ``metrics.speculative_decoding`` to each response (num_spec_steps, num_draft_tokens,
   num_accepted_draft_tokens, acceptance_histogram = steps by number of accepted drafts). Summed over
   our own requests, immune to other traffic.
2. /metrics: the Prometheus counters vllm:spec_decode_num_drafts_total, _num_draft_tokens_total,
   _num_accepted_tokens_total and _num_accepted_tokens_per_pos_total{position="i"}, read before and
   after the generation phase; the difference is ours only if nobody else used the server meanwhile,
   which vllm:request_success_total tells (it must move by exactly our request count).
Either way the result is mlaq's ``SpecDecodingStats`` (vLLM's counters), so the rates are vLLM's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.engine.spec_metrics import SpecDecodingStats

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS = "vllm:request_success_total"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse_prometheus(text: str) -> list[Sample]:
    """Samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = tuple(
            (k, v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\"))
            for k, v in _LABEL.findall(m.group(3) or "")
        )
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append(Sample(m.group(1), labels, value))
    return out


@dataclass(frozen=True)
class Counters:
    """The spec-decode and request counters of one scrape, summed over label sets of one model."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    per_pos: tuple[float, ...]
    requests: float
    has_spec: bool  # the server exports the spec-decode counters at all


def counters(samples: Iterable[Sample], model_name: str | None = None) -> Counters:
    """Sum each counter over its label sets (only ``model_name``'s when the label is present)."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for s in samples:
        model = s.label("model_name")
        if model_name is not None and model is not None and model != model_name:
            continue
        if s.name == PER_POS:
            pos = s.label("position")
            if pos is not None and pos.isdigit():
                per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + s.value
        elif s.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED, REQUESTS):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    n = max(per_pos) + 1 if per_pos else 0
    return Counters(
        sums.get(DRAFTS, 0.0),
        sums.get(DRAFT_TOKENS, 0.0),
        sums.get(ACCEPTED, 0.0),
        tuple(per_pos.get(i, 0.0) for i in range(n)),
        sums.get(REQUESTS, 0.0),
        DRAFTS in sums,
    )


@dataclass(frozen=True)
class CounterDelta:
    stats: SpecDecodingStats | None  # None: the server exports no spec-decode counters
    requests: int  # how much vllm:request_success_total moved
    ours: int  # how many requests we sent meanwhile
    warning: str | None  # set when other traffic moved the counters


def counter_delta(before: Counters, after: Counters, ours: int) -> CounterDelta:
    """The counters' movement between two scrapes around ``ours`` requests of our own."""
    moved = round(after.requests - before.requests)
    warning = None
    if moved > ours:
        warning = (
            f"vllm:request_success_total moved by {moved} while mlaq sent {ours} requests: other traffic "
            "shared the server, so the /metrics acceptance figures include it (start the server with "
            "--per-request-spec-decode-metrics summary for per-request figures)"
        )
    if not after.has_spec:
        return CounterDelta(None, moved, ours, warning)
    n = max(len(before.per_pos), len(after.per_pos))
    b = before.per_pos + (0.0,) * (n - len(before.per_pos))
    a = after.per_pos + (0.0,) * (n - len(after.per_pos))
    stats = SpecDecodingStats(
        round(after.num_drafts - before.num_drafts),
        round(after.num_draft_tokens - before.num_draft_tokens),
        round(after.num_accepted_tokens - before.num_accepted_tokens),
        tuple(round(y - x) for x, y in zip(b, a, strict=True)),
    )
    return CounterDelta(stats, moved, ours, warning)


def per_request_stats(metrics: Mapping[str, Any] | None) -> SpecDecodingStats | None:
    """One response's ``metrics.speculative_decoding`` as vLLM counters (None when absent).

    The histogram counts verification steps by accepted drafts (index or key = accepted count, the
    bonus token excluded); per position i, accepted_per_pos[i] = steps that accepted more than i.
    """
    if not metrics:
        return None
    spec = metrics.get("speculative_decoding")
    if not isinstance(spec, Mapping):
        return None
    hist = spec.get("acceptance_histogram")
    if isinstance(hist, Mapping):
        hist_map = {int(k): int(v) for k, v in hist.items()}
    elif isinstance(hist, list):
        hist_map = {i: int(v) for i, v in enumerate(hist)}
    else:
        hist_map = {}
    steps = int(spec.get("num_spec_steps", sum(hist_map.values())))
    k = int(spec.get("num_spec_tokens") or (max(hist_map) if hist_map else 0))
    accepted = int(spec.get("num_accepted_draft_tokens", sum(a * c for a, c in hist_map.items())))
    draft_tokens = int(spec.get("num_draft_tokens", steps * k))
    # no histogram (SGLang's counters): the per-position figures are unknown, not zero
    per_pos = tuple(sum(c for a, c in hist_map.items() if a > i) for i in range(k)) if hist_map else ()
    return SpecDecodingStats(steps, draft_tokens, accepted, per_pos)


def total(stats: Iterable[SpecDecodingStats | None]) -> SpecDecodingStats | None:
    """Sum of the non-None stats (None when there is none)."""
    out: SpecDecodingStats | None = None
    for s in stats:
        if s is not None:
            out = s if out is None else out + s
    return out
