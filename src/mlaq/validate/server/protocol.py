"""The wire formats mlaq reads from an OpenAI-compatible server, parsed into plain records.

Teacher forcing sends a window of T token ids as the prompt and reads, for every position t < T - 1,
the distribution that predicts token t + 1 — in one of two shapes:
- vLLM's ``prompt_logprobs`` (``choices[0].prompt_logprobs``: ``[null, {"id": {"logprob": x, ...}}, ...]``,
  keyed by token id, the actual token always included);
- OpenAI's ``echo`` + ``logprobs`` (``choices[0].logprobs.top_logprobs``: ``[null, {"token": x}, ...]``),
  readable only when the keys are token ids (vLLM's ``return_tokens_as_token_ids`` writes
  ``"token_id:123"``): token text is ambiguous, so a text-keyed answer is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlaq.validate.server.client import ServerError, Unsupported

NO_LOGPROBS = (
    "server does not return prompt logprobs: echo with logprobs (or vLLM's prompt_logprobs) is required "
    "for teacher-forced metrics"
)


@dataclass(frozen=True)
class TeacherForced:
    """One window scored by one server: T tokens, T - 1 predicted positions."""

    tokens: tuple[int, ...]
    token_logprobs: np.ndarray  # (T-1,) float64: log p(tokens[t+1] | tokens[:t+1])
    top: tuple[dict[int, float], ...]  # T-1 maps token id -> log-probability (top-k + actual token)

    def __post_init__(self) -> None:
        n = len(self.tokens) - 1
        if self.token_logprobs.shape != (n,) or len(self.top) != n:
            raise ServerError(
                f"server returned {len(self.top)} prompt logprobs for a prompt of {len(self.tokens)} tokens "
                f"(expected {n}); is it tokenizing the prompt ids again?"
            )


@dataclass(frozen=True)
class Greedy:
    """A greedy completion: its token ids and, when the server reports them, its MTP counters."""

    tokens: tuple[int, ...]
    spec: Mapping[str, Any] | None  # the response's ``metrics`` object, if any
    ids_from_text: bool = False  # ids recovered by tokenizing the returned text (approximate)
    # per generated token, the top-k distribution it was drawn from (None: not returned with ids).
    # Token 0's comes from the prefill; the others from the decode path (the absorbed BMMs).
    top: tuple[dict[int, float], ...] | None = None


def token_id(key: str | int, *, prefixed: bool = False) -> int | None:
    """``"token_id:123"`` -> 123, and (unless ``prefixed``: keys that may be token text) ``123`` or
    ``"123"`` -> 123; anything else -> None."""
    if isinstance(key, int):
        return None if prefixed else key
    if key.startswith("token_id:"):
        key = key.removeprefix("token_id:")
    elif prefixed:
        return None
    return int(key) if key.lstrip("-").isdigit() else None


def _ids_map(entry: Mapping[str, Any], what: str, prefixed: bool) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in entry.items():
        tid = token_id(k, prefixed=prefixed)
        if tid is None:
            raise Unsupported(
                f"server keys {what} by token text ({k!r}), not token ids; mlaq needs ids to compare two "
                "servers exactly (vLLM: prompt_logprobs, or return_tokens_as_token_ids)"
            )
        lp = v["logprob"] if isinstance(v, Mapping) else v
        out[tid] = float("-inf") if lp is None else float(lp)
    return out


def _choice(response: Any) -> Mapping[str, Any]:
    try:
        return response["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ServerError(f"completions response without choices: {str(response)[:200]}") from None


def parse_prompt_logprobs(response: Any, tokens: Sequence[int]) -> TeacherForced | None:
    """vLLM's ``prompt_logprobs`` shape (None when the response does not carry it)."""
    plp = _choice(response).get("prompt_logprobs")
    if not isinstance(plp, list):
        return None
    entries = plp[1 : len(tokens)]  # entry 0 (the first token) has no prediction
    top = tuple(_ids_map(e or {}, "prompt_logprobs", False) for e in entries)
    lps = []
    for t, d in zip(tokens[1:], top, strict=False):
        if t not in d:
            raise ServerError(f"prompt_logprobs lack the prompt's own token {t} at a position")
        lps.append(d[t])
    return TeacherForced(tuple(tokens), np.array(lps, dtype=np.float64), top)


def parse_echo_logprobs(response: Any, tokens: Sequence[int]) -> TeacherForced:
    """OpenAI's ``echo`` + ``logprobs`` shape with id keys; Unsupported when logprobs are absent."""
    lp = _choice(response).get("logprobs")
    if not isinstance(lp, Mapping) or not lp.get("token_logprobs") or not lp.get("top_logprobs"):
        raise Unsupported(NO_LOGPROBS)
    n = len(tokens)
    token_lps, tops = lp["token_logprobs"], lp["top_logprobs"]
    if len(token_lps) < n:
        raise Unsupported(f"{NO_LOGPROBS} (the response echoes {len(token_lps)} of {n} prompt tokens)")
    top = tuple(_ids_map(e or {}, "top_logprobs", True) for e in tops[1:n])
    values = [float("-inf") if x is None else float(x) for x in token_lps[1:n]]
    for t, d, v in zip(tokens[1:], top, values, strict=True):
        d.setdefault(t, v)  # the actual token's log-probability is always known
    return TeacherForced(tuple(tokens), np.array(values, dtype=np.float64), top)


def parse_greedy_top(response: Any) -> tuple[dict[int, float], ...] | None:
    """The generated tokens' top-k maps when keyed by ids (``token_id:N``), else None."""
    lp = _choice(response).get("logprobs")
    tops = lp.get("top_logprobs") if isinstance(lp, Mapping) else None
    if not isinstance(tops, list) or not tops or any(not isinstance(t, Mapping) for t in tops):
        return None
    try:
        return tuple(_ids_map(t, "top_logprobs", True) for t in tops)
    except Unsupported:
        return None


def parse_greedy_ids(response: Any) -> tuple[tuple[int, ...] | None, str]:
    """(token ids if the response carries them, the completion text)."""
    choice = _choice(response)
    text = choice.get("text") or ""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return tuple(ids), text
    lp = choice.get("logprobs")
    if isinstance(lp, Mapping) and isinstance(lp.get("tokens"), list):
        parsed = [token_id(t, prefixed=True) for t in lp["tokens"]]
        if parsed and all(p is not None for p in parsed):
            return tuple(p for p in parsed if p is not None), text
    return None, text
