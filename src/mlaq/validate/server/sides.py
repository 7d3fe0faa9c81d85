"""What one run measured on each side (a live server or a recording), the inputs both sides got, and
the tokenization that chose them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlaq.validate.server.protocol import Greedy, TeacherForced
from mlaq.validate.server.target import ServerTarget


@dataclass
class Side:
    """Everything measured on one side (a live server, or a recording)."""

    identity: dict[str, Any]
    windows: list[TeacherForced] | None = None
    generations: list[Greedy] | None = None
    acceptance: Any = None  # SpecDecodingStats | None
    acceptance_source: str | None = None  # "per_request" | "metrics" | "recording"
    seconds: dict[str, float] = field(default_factory=dict)
    tasks: list[Any] | None = None  # TaskScoreRecord per task sample
    sample: str = ""  # the first prompt's completion, decoded
    errors: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # --mc-kl: prompt + a continuation sampled from the reference, scored teacher-forced on this side;
    # mc_start[i]: where sequence i's sampled tokens begin
    mc: list[TeacherForced] | None = None
    mc_start: list[int] = field(default_factory=list)


@dataclass
class Inputs:
    windows: list[list[int]]
    prompts: list[list[int]]
    context_len: int
    max_tokens: int
    eval_text: dict[str, Any]
    prompt_sample: str = ""
    text_tokens: tuple[int, ...] = ()  # the whole evaluation text (the task suite's haystack)


class Tokenizing:
    """``encode`` for load_eval_text: the local --tokenizer when given (exact, as local validate), else
    the server's /tokenize over line-aligned chunks (a long text in one request may exceed the
    server's limits)."""

    CHUNK = 8192  # characters

    def __init__(self, target: ServerTarget, local: Path | None) -> None:
        self.target, self.local = target, local

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.local is not None:
            from mlaq.engine.tokenizer import Tokenizer

            p = self.local
            return Tokenizer.from_dir(p.parent if p.name == "tokenizer.json" else p).encode(text, False)
        chunks, start = [], 0
        while start < len(text):
            end = text.find("\n", start + self.CHUNK)
            end = len(text) if end < 0 else end + 1
            chunks.append(text[start:end])
            start = end
        with ThreadPoolExecutor(max_workers=4) as ex:
            parts = list(ex.map(self.target.tokenize, chunks))
        return [t for part in parts for t in part]
