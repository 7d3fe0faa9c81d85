"""What every route needs: the settings, the engine loop, the tokenizer, the metrics."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from mlaq.engine.tokenizer import Tokenizer
from mlaq.serve.async_engine import AsyncEngine
from mlaq.serve.config import ServeConfig
from mlaq.serve.errors import APIError
from mlaq.serve.logprobs import TokenText
from mlaq.serve.metrics import ServerMetrics


@dataclass
class ServerState:
    config: ServeConfig
    engine: AsyncEngine
    tokenizer: Tokenizer | None
    metrics: ServerMetrics
    vocab_size: int
    num_spec_tokens: int
    token_text: TokenText = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.token_text = TokenText(self.tokenizer, self.config.return_tokens_as_token_ids)

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (None / empty: the served one, as vLLM)."""
        if name and name != self.config.served_model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.config.served_model_name}`.",
                "model",
            )

    def need_tokenizer(self, what: str) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(
                400, f"{what} needs the checkpoint's tokenizer.json; this model has none (send token ids)"
            )
        return self.tokenizer

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"{param}: token ids {bad[:5]} are outside the vocabulary (size {self.vocab_size}).",
                param,
            )


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created_now() -> int:
    """A reply's ``created``: when its request arrived (Unix seconds), as OpenAI and vLLM set it."""
    return int(time.time())
