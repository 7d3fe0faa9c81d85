"""Logprobs in the OpenAI wire formats: the legacy completions block (tokens, token_logprobs,
top_logprobs, text_offset), the chat ``content`` list, and vLLM's ``prompt_logprobs`` list.

Token text is each token decoded on its own (special tokens kept), or ``token_id:N`` when the
request or the server asks for ids (vLLM's ``return_tokens_as_token_ids``: unambiguous where two
tokens decode to the same text). ``-inf`` (a token the model rules out) is sent as -9999.0, as vLLM
does, because JSON has no infinity.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mlaq.engine.tokenizer import Tokenizer


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class TokenText:
    """Token id -> its text in logprob replies (memoized per server)."""

    tokenizer: Tokenizer | None
    as_ids: bool = False
    _cache: dict[int, str] = field(default_factory=dict)

    def __call__(self, token_id: int, as_ids: bool | None = None) -> str:
        if (self.as_ids if as_ids is None else as_ids) or self.tokenizer is None:
            return f"token_id:{token_id}"
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _top(entry: dict[int, float], n: int, chosen: int) -> list[tuple[int, float]]:
    """The top ``n`` of an entry (-1: all), most likely first; the chosen token only if it is among them."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])
    return ranked if n < 0 else ranked[:n]


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float] | None],
    n: int,
    text: TokenText,
    as_ids: bool | None,
    offset: int,
) -> tuple[dict[str, Any], int]:
    """The legacy block for ``token_ids`` (entry None: the first prompt token, no logprob); returns
    it and the text offset after it."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries, strict=True):
        s = text(token, as_ids)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(_finite(entry[token]))
        top = {text(t, as_ids): _finite(v) for t, v in _top(entry, n, token)}
        top.setdefault(s, _finite(entry[token]))  # vLLM: the chosen token is always in top_logprobs
        top_logprobs.append(top)
    block = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return block, offset


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, float]],
    n: int,
    text: TokenText,
    as_ids: bool | None,
) -> list[dict[str, Any]]:
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        s = text(token, as_ids)
        top = [
            {"token": text(t, as_ids), "logprob": _finite(v), "bytes": list(text(t, as_ids).encode())}
            for t, v in _top(entry, n, token)
        ]
        content.append(
            {"token": s, "logprob": _finite(entry[token]), "bytes": list(s.encode()), "top_logprobs": top}
        )
    return content


def prompt_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, float] | None], text: TokenText, as_ids: bool | None
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None, then per prompt token {token_id: {logprob, rank, decoded_token}}
    holding the prompt token and the top N (rank 1 = most likely)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for token, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])
        ranks = {t: i + 1 for i, (t, _) in enumerate(ranked)}
        chosen_rank = 1 + sum(1 for _, v in ranked if v > entry[token])  # among those returned
        out.append(
            {
                str(t): {
                    "logprob": _finite(v),
                    "rank": chosen_rank if t == token else ranks[t],
                    "decoded_token": text(t, as_ids),
                }
                for t, v in entry.items()
            }
        )
    return out
