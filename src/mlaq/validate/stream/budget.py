"""The memory budget of a streamed validation: parse it, plan within it, measure what was used.

Planning is the enforcement: before any weight is read, the run's peak is estimated from the
checkpoint's headers (what one layer, one routed expert and the head hold in every compute dtype, the
stored bytes being dequantized, the windows' hidden states of every stream, the attention scores of a
query chunk) and the largest query chunk that fits is chosen; if even one query row at a time does not
fit, the run stops with the size it needs. The resident set actually reached is measured (peak RSS)
and reported beside the budget.
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
DEFAULT_BUDGET = "8GiB"
SLACK = 1.25  # multiplies the estimated working memory: allocator fragmentation, temporaries not counted


def parse_size(text: str) -> int:
    """'8GiB', '2 GB', '512MiB', '1.5G' (K/M/G/T alone are binary) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"--memory-budget {text!r}: expected a size such as 8GiB, 2GB, 512MiB or 1.5G "
            "(KiB/MiB/GiB/TiB binary, KB/MB/GB/TB decimal)"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"--memory-budget {text!r}: must be more than 0 bytes")
    return value


@dataclass(frozen=True)
class StreamConfig:
    """What ``--stream`` adds to a local run: the memory it may use (bytes), and a cap on the query chunk
    the plan picks (None: the plan's; tests force the chunked path with it)."""

    memory_budget: int
    max_chunk: int | None = None

    @classmethod
    def parse(cls, budget: str | int | None = None, max_chunk: int | None = None) -> StreamConfig:
        """``--memory-budget`` as given ('8GiB', bytes, or None: the default)."""
        text = DEFAULT_BUDGET if budget is None else budget
        return cls(text if isinstance(text, int) else parse_size(text), max_chunk)


def reads(bytes_read: int, total: int, elapsed: float) -> str:
    """``1.20 / 8.00 GB read, ETA 240 s, peak RSS 2.10 GiB``: the ETA extrapolates from the bytes read
    against the bytes the plan reads (reading, and the compute after each read, scale with a layer's size)."""
    eta = f"{elapsed * (total - bytes_read) / bytes_read:.0f} s" if bytes_read else "?"
    return f"{_size(bytes_read)} / {_size(total)} read, ETA {eta}, peak RSS {peak_rss() / 2**30:.2f} GiB"


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def gib(n: float) -> str:
    """Bytes as a short human figure (GiB above 1 GiB, else MiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def current_rss() -> int:
    """The process's resident set now, bytes (Linux /proc; the peak as a fallback elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss()


def peak_rss() -> int:
    """The process's peak resident set so far, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class Shape:
    """What the estimate needs to know about the run."""

    hidden: int
    heads: int
    qk_nope: int
    rope: int
    lora: int
    v_head: int
    vocab: int
    tokens: int  # T, the window length
    windows: int
    stream_bytes: tuple[int, ...]  # element size of each stream's compute dtype
    variants: int  # variants whose absorbed weights are prepared per layer
    index_heads: int = 0  # DSA indexer heads (0: no indexer)
    experts_per_token: int = 0
    moe_intermediate: int = 0
    task_tokens: int = 0  # the task suite's samples (stream/tasks.py task_shape; 0: no suite)
    task_len: int = 0  # the longest sample
    task_batch: int = 0  # the most samples in one batch
    task_hidden: int = 0  # bytes per hidden unit of every prefix copy's and tail's hidden states


@dataclass(frozen=True)
class Plan:
    budget: int
    baseline: int  # resident before the run (interpreter, torch, the tokenized text)
    chunk: int  # attention query rows per call
    head_chunk: int  # positions per lm_head call
    estimate: int  # the planned peak
    parts: dict[str, int]  # what makes up the estimate at its largest stage

    def to_json(self) -> dict[str, object]:
        return {
            "budget_bytes": self.budget,
            "baseline_bytes": self.baseline,
            "estimated_peak_bytes": self.estimate,
            "attention_chunk": self.chunk,
            "head_chunk": self.head_chunk,
            "parts": dict(self.parts),
        }


def _streams(s: Shape) -> int:
    """Hidden states of every stream and window and of the task samples, with the layer's transient
    copies (x, x + out), and the task prefixes' latent cache at one layer."""
    windows = sum(2 * s.windows * s.tokens * s.hidden * b for b in s.stream_bytes)
    tasks = 2 * s.hidden * s.task_hidden + s.task_tokens * (s.lora + s.rope) * max(s.stream_bytes)
    return windows + tasks


def _task_attention(s: Shape, chunk: int) -> int:
    """One batch of task samples through one attention call: projections, the naive path's decompressed
    keys and values, the scores of a query chunk."""
    if not s.task_tokens:
        return 0
    t, n, b = s.task_len, s.heads, max(s.stream_bytes)
    proj = t * n * (s.qk_nope + 2 * s.rope) * b * 3 + t * (s.lora + s.rope) * 4
    naive = t * n * (s.qk_nope + s.v_head) * b * 2
    scores = 5 * n * min(chunk, t) * t * 4
    index = 3 * min(chunk, t) * s.index_heads * t * 4 if s.index_heads else 0
    return s.task_batch * (proj + naive + scores + index + t * t + t * s.hidden * 4)


def _attention(s: Shape, chunk: int) -> int:
    t, n, b = s.tokens, s.heads, max(s.stream_bytes)
    proj = t * n * (s.qk_nope + 2 * s.rope) * b * 3 + t * (s.lora + s.rope) * 4  # q, rotated pe, keys
    scores = 5 * n * chunk * t * 4  # scores, masked, softmax, probs (fp32), where
    bmm = n * chunk * (s.qk_nope + 3 * s.lora + 2 * s.rope + 2 * s.v_head) * 4 * 2
    index = 3 * chunk * s.index_heads * t * 4 if s.index_heads else 0
    masks = s.windows * len(s.stream_bytes) * t * t if s.index_heads else t * t  # bool
    capture = s.windows * t * s.hidden * (4 + b) + n * t * (s.qk_nope + s.lora) * 4  # ref in/out, BMM inputs
    flips = n * chunk * t * (4 * 3 + 8 * 3)  # both rows' weights (fp32), their float64 difference
    return max(proj + scores + bmm + index + masks + capture + flips, _task_attention(s, chunk))


def _moe(s: Shape) -> int:
    if not s.experts_per_token:
        return 0
    tokens = s.windows * s.tokens * sum(s.stream_bytes) + s.task_hidden  # x element bytes
    biggest = max(s.tokens, s.task_batch * s.task_len)
    return tokens * s.hidden * (s.experts_per_token + 2) + biggest * s.moe_intermediate * 4 * 3


def _head(s: Shape, chunk: int) -> int:
    return chunk * s.vocab * (4 * 5 + 8 * 3)  # logits, log-softmax, exp (fp32); KL terms in float64


def plan(
    s: Shape,
    budget: int,
    baseline: int,
    layer_bytes: int,
    expert_bytes: int,
    head_bytes: int,
    max_chunk: int | None = None,
) -> Plan:
    """The largest power-of-two chunks whose estimated peak fits ``budget``; a ValueError naming the
    size needed when none does. ``layer_bytes`` / ``expert_bytes`` / ``head_bytes``: the heaviest
    layer (without routed experts), routed expert and head as held (every dtype, plus the transient
    dequantization), from :func:`held_bytes`."""
    streams = _streams(s)

    def layer_peak(chunk: int) -> dict[str, int]:
        return {
            "baseline": baseline,
            "hidden states": streams,
            "layer weights": layer_bytes,
            "one routed expert": expert_bytes,
            "attention workspace": int(SLACK * max(_attention(s, chunk), _moe(s))),
        }

    def head_peak(chunk: int) -> dict[str, int]:
        return {
            "baseline": baseline,
            "hidden states": streams,
            "head weights": head_bytes,
            "logits workspace": int(SLACK * _head(s, chunk)),
        }

    longest = max(s.tokens, s.task_len)  # a chunk this long runs every attention call whole
    cap = longest if max_chunk is None else max(1, min(max_chunk, longest))
    chunk, head_chunk = _fit(cap, layer_peak, budget), _fit(cap, head_peak, budget)
    if chunk == 0 or head_chunk == 0:
        parts = layer_peak(1) if chunk == 0 else head_peak(1)
        need = sum(parts.values())
        detail = ", ".join(f"{k} {gib(v)}" for k, v in parts.items() if v)
        raise ValueError(
            f"--memory-budget {gib(budget)} is too small: the {'heaviest layer' if chunk == 0 else 'head'} "
            f"needs at least {gib(need)} ({detail}); give --memory-budget {_round_up(need)} or more, "
            "or fewer --windows / a shorter --context-len / fewer --schemes"
            + (" / fewer --lengths or --task-samples (or --tasks none)" if s.task_tokens else "")
        )
    layer, head = layer_peak(chunk), head_peak(head_chunk)
    worst = layer if sum(layer.values()) >= sum(head.values()) else head
    return Plan(budget, baseline, chunk, head_chunk, sum(worst.values()), worst)


def _fit(tokens: int, peak, budget: int) -> int:
    chunk = 1 << max(tokens - 1, 0).bit_length()  # the power of two >= T
    while chunk >= 1:
        if sum(peak(min(chunk, tokens)).values()) <= budget:
            return min(chunk, tokens)
        chunk //= 2
    return 0


def _round_up(n: int) -> str:
    """A budget to suggest: n rounded up to 0.5 GiB."""
    halves = -(-n // 2**29)
    return f"{halves / 2:g}GiB"


def held_bytes(numel: int, largest_stored: int, fp32_transient: int, dtype_bytes: tuple[int, ...]) -> int:
    """Memory of ``numel`` parameters held in each compute dtype, plus the transient of reading and
    dequantizing the largest tensor (its stored bytes plus ``fp32_transient`` fp32 elements)."""
    return numel * sum(dtype_bytes) + largest_stored + fp32_transient * 4
