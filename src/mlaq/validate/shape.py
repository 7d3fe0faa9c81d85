"""The shape of a validation run: what every source (engine, layer stream, live servers) measures the same.

``mlaq validate`` builds one :class:`RunShape` from its arguments; each source's own settings hold it
beside what only that source needs (``ValidateConfig``: the checkpoint, schemes and engine precision;
``ServerValidateConfig``: the URLs, keys and timeouts; ``StreamConfig``: the memory budget). No heavy
imports: the ``--server`` path needs no torch to build it.

    shape = RunShape(eval_text=Path("heldout.txt"), context_len=1024, windows=4)
    ValidateConfig(model=Path("ckpt"), shape=shape, schemes=("mxfp4",))  # or ServerValidateConfig(client, shape)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mlaq.validate import defaults as d
from mlaq.validate.tasks.spec import TaskConfig


@dataclass(frozen=True)
class RunShape:
    """The text, windows, prompts and tasks of one run. Sizes default to a run of a few minutes on two
    CPU cores."""

    eval_text: Path | None = (
        None  # None: the bundled model's held-out text (a local source resolves it first)
    )
    context_len: int | None = None  # None: the model's (or server's) context, at most d.MAX_DEFAULT_CONTEXT
    windows: int = d.WINDOWS  # teacher-forced windows of context_len tokens
    buckets: int = d.BUCKETS  # context-position buckets
    prompts: int = d.PROMPTS  # free-running greedy generations
    prompt_len: int = d.PROMPT_LEN
    max_tokens: int = d.MAX_TOKENS
    ngram: int = d.NGRAM  # n of the repeated n-gram share
    seed: int = 0  # picks windows and prompts (and seeds the engine)
    tasks: TaskConfig | None = None  # the long-context task suite (None: not run)

    def __post_init__(self) -> None:
        positive = {
            "--windows": self.windows,
            "--buckets": self.buckets,
            "--prompts": self.prompts,
            "--prompt-len": self.prompt_len,
            "--max-tokens": self.max_tokens,
            "--ngram": self.ngram,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.context_len is not None and self.context_len < 2:
            raise ValueError(f"--context-len must be at least 2 tokens, got {self.context_len}")
