"""What the local sources (the engine, the layer stream) read before any model work: the evaluation
text's windows and prompts, the position buckets, the task samples; and how the record describes the text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlaq.engine.tokenizer import Tokenizer
from mlaq.validate.config import ValidateConfig
from mlaq.validate.metrics import Buckets
from mlaq.validate.tasks.run import Drawn, draw_suite
from mlaq.validate.text import EvalData, load_eval_text


@dataclass(frozen=True)
class LocalInputs:
    """A local run's inputs: the text's windows and prompts, the position buckets, the task samples."""

    tokenizer: Tokenizer
    data: EvalData
    buckets: Buckets
    drawn: Drawn | None  # None: no task suite


def local_inputs(config: ValidateConfig, context: int, max_position_embeddings: int) -> LocalInputs:
    """Tokenize the text, choose windows and prompts, draw the task samples: before any model work, so a
    bad length or a haystack too short fails now. A prompt is at most ``context - 1`` tokens."""
    shape = config.shape
    assert shape.eval_text is not None  # ValidateConfig checks it
    tokenizer = Tokenizer.from_dir(config.model)
    data = load_eval_text(
        shape.eval_text,
        tokenizer,
        context_len=context,
        windows=shape.windows,
        prompts=shape.prompts,
        prompt_len=min(shape.prompt_len, context - 1),
        seed=shape.seed,
    )
    drawn = None
    if shape.tasks is not None:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        drawn = draw_suite(shape.tasks, max_position_embeddings, str(config.model), data, encode)
    return LocalInputs(tokenizer, data, Buckets(context, min(shape.buckets, context)), drawn)


def eval_text_info(data: EvalData, prompt_sample: str) -> dict[str, Any]:
    return {
        "path": str(data.path),
        "sha256": data.sha256,
        "bytes": data.num_bytes,
        "tokens": len(data.tokens),
        "window_starts": list(data.window_starts),
        "prompt_starts": list(data.prompt_starts),
        "prompt_sample": prompt_sample,
    }
