"""The evaluation text: tokenized once, cut into teacher-forcing windows and generation prompts.

Windows are non-overlapping slots of ``context_len`` tokens; which slots, and where the prompts start,
is drawn from ``seed`` (so a run is reproducible and a different seed samples other text).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from mlaq.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class EvalData:
    path: Path
    sha256: str
    num_bytes: int
    tokens: tuple[int, ...]
    window_starts: tuple[int, ...]  # token offsets of the teacher-forcing windows
    prompt_starts: tuple[int, ...]  # token offsets of the generation prompts
    context_len: int
    prompt_len: int

    def windows(self) -> list[torch.Tensor]:
        """(1, T) id tensors."""
        return [torch.tensor([self.tokens[s : s + self.context_len]]) for s in self.window_starts]

    def prompts(self) -> list[list[int]]:
        return [list(self.tokens[s : s + self.prompt_len]) for s in self.prompt_starts]


def load_eval_text(
    path: Path,
    tokenizer: Tokenizer,
    *,
    context_len: int,
    windows: int,
    prompts: int,
    prompt_len: int,
    seed: int,
) -> EvalData:
    """Read and tokenize ``path``; choose ``windows`` windows and ``prompts`` prompt starts."""
    if not path.is_file():
        raise FileNotFoundError(
            f"evaluation text {path} not found; pass --eval-text PATH to an existing file"
        )
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"evaluation text {path} is not UTF-8 text ({exc})") from None
    tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
    slots = len(tokens) // context_len
    if slots == 0:
        raise ValueError(
            f"evaluation text {path} has {len(tokens)} tokens, fewer than one window of --context-len "
            f"{context_len}; give a longer text or a smaller --context-len"
        )
    if len(tokens) <= prompt_len:
        raise ValueError(
            f"evaluation text {path} has {len(tokens)} tokens, not more than --prompt-len {prompt_len}"
        )
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(slots, generator=gen)[: min(windows, slots)]
    window_starts = tuple(sorted(int(s) * context_len for s in chosen))
    prompt_starts = tuple(
        int(s) for s in torch.randint(0, len(tokens) - prompt_len, (prompts,), generator=gen)
    )
    return EvalData(
        path,
        hashlib.sha256(raw).hexdigest(),
        len(raw),
        tokens,
        window_starts,
        prompt_starts,
        context_len,
        prompt_len,
    )
