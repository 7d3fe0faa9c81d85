"""Surface forms: the text of facts and queries, and their tokenization.

The bundled model is trained on Python, so every fact is one line of Python that also reads as a
plain statement inside prose: ``kavo_mute = 48213`` (needle), ``table["ribo_desa"] = 70215``
(multikey, a dict entry), ``data = "tuvi rado ..."`` (copy), ``x2 = x1`` (vartrack), and every query is
an ``assert`` whose right-hand side the model must complete: ``assert kavo_mute ==`` -> `` 48213``.
Keys are random pronounceable identifiers, values random 5-digit numbers, fresh per sample.

Tokenization: each fact and the query are tokenized on their own and spliced between haystack tokens
at token boundaries. The answer's ids are those of the query text followed by the answer text, minus
the query's ids, and they must also occur inside the fact (the model can copy them); a draw that a
tokenizer splits otherwise is redrawn.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from mlaq.validate.tasks.haystack import find

Encode = Callable[[str], list[int]]

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def word(rng: random.Random, syllables: int = 2) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def identifier(rng: random.Random) -> str:
    """A fresh variable name such as ``kavo_mute`` (14^4 * 5^4 = 24 million choices)."""
    return f"{word(rng)}_{word(rng)}"


def distinct(rng: random.Random, n: int, make: Callable[[random.Random], str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = make(rng)
        if v not in out:
            out.append(v)
    return out


def number(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 100_000))


def line(encode: Encode, text: str) -> list[int]:
    """A fact as its own line: newline before and after, so it also stands apart inside prose."""
    return encode(f"\n{text}\n")


def query_and_answer(
    encode: Encode, query: str, answer: str, fact: Sequence[int]
) -> tuple[list[int], list[int]] | None:
    """(query ids, answer ids) for the prompt tail ``\\n{query}`` completed by ``answer``; None when the
    tokenizer merges the two across their boundary or the answer's ids do not occur in ``fact``."""
    head = encode(f"\n{query}")
    full = encode(f"\n{query}{answer}")
    if full[: len(head)] != head or len(full) == len(head):
        return None
    ids = full[len(head) :]
    if find(ids, fact) < 0:
        return None
    return head, ids
