"""The haystack: any plain text file (prose or code), tokenized once, read from a random offset.

A sample's filler is ``n`` consecutive tokens starting at a seeded offset; when the text holds fewer
tokens than a sample needs, reading wraps around to the start (the text repeats) and the report says
so, since a repeated haystack makes the context easier to predict than fresh text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Haystack:
    """Token ids of a text; ``name`` says where they came from (a path, for the report)."""

    name: str
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ValueError(
                f"haystack {self.name} is empty: give a text file with some content as --eval-text"
            )

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, start: int, n: int) -> list[int]:
        """``n`` tokens from ``start`` (mod the length), wrapping around at the end."""
        size = len(self.tokens)
        start %= size
        out: list[int] = []
        while len(out) < n:
            piece = self.tokens[start : start + n - len(out)]
            out.extend(piece)
            start = 0
        return out

    def wraps(self, n: int) -> bool:
        """Whether a sample needing ``n`` filler tokens repeats the text."""
        return n > len(self.tokens)


def load_haystack(path: Path, encode) -> Haystack:
    """Tokenize the UTF-8 text at ``path`` with ``encode(text) -> ids``; clear errors for a bad file."""
    if not path.is_file():
        raise FileNotFoundError(
            f"haystack text {path} not found; pass --eval-text PATH to an existing text file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"haystack text {path} is not UTF-8 text ({exc})") from None
    return Haystack(str(path), tuple(encode(text)))


def count(needle: Sequence[int], haystack: Sequence[int]) -> int:
    """Occurrences of the token sequence ``needle`` in ``haystack`` (overlapping ones included)."""
    n = len(needle)
    if n == 0:
        return 0
    first = needle[0]
    target = list(needle)
    return sum(
        1
        for i in range(len(haystack) - n + 1)
        if haystack[i] == first and list(haystack[i : i + n]) == target
    )


def find(needle: Sequence[int], haystack: Sequence[int]) -> int:
    """Index of the first occurrence of ``needle`` in ``haystack``; -1 if absent."""
    n = len(needle)
    target = list(needle)
    for i in range(len(haystack) - n + 1):
        if haystack[i] == target[0] and list(haystack[i : i + n]) == target:
            return i
    return -1
