"""Incremental detokenization for streaming, and stop-string detection, as vLLM does them.

Text is decoded over a sliding window of tokens (vLLM's prefix/read offsets) so that each new
token costs O(window), and a token that ends inside a multi-byte character (decoded as U+FFFD)
yields no text until the character is complete. The window starts 5 tokens into the prompt's end
so that tokenizers whose decoders treat the first token specially (a leading space) still see
context.

A stop string may straddle tokens: after each token the text is searched from
``len(stop) - 1`` characters before the new text. On a hit the output is cut before the stop
string (vLLM's default; ``include_stop_str_in_output`` keeps it) and generation ends at that
token. A stream holds back the last ``max(len(stop)) - 1`` characters until it finishes, because
they might still become the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.tokenizer import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET


class IncrementalDetokenizer:
    """Text of one request's output, grown token by token; ``stop_reason`` once a stop string hit."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids = context  # window tokens: prompt context, then the output tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self.stop_reason: str | None = None
        self._sent = 0  # characters already returned by next_delta
        self._holdback = 0 if params.include_stop_str_in_output else max(params.max_stop_len - 1, 0)

    def add_token(self, token_id: int, skip_text: bool = False, check_stop: bool = True) -> bool:
        """Append one generated token; True when it completed a stop string (generation must end).

        ``skip_text``: the token stops generation itself (EOS or a stop token id) and, as in vLLM,
        its text is not added to the output unless ``include_stop_str_in_output``. ``check_stop``
        False: the text grows but no stop string can end it yet (vLLM's min_tokens).
        """
        if self.stop_reason is not None:
            raise ValueError("this request already stopped; no more tokens can be added")
        if skip_text and not self.params.include_stop_str_in_output:
            return False
        self._ids.append(token_id)
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], skip)
        full = self.tokenizer.decode(self._ids[self._prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence (or no visible text yet): wait for more
        new_text = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self.output_text += new_text
        return check_stop and self._check_stop(len(new_text))

    def _check_stop(self, new_chars: int) -> bool:
        text = self.output_text
        for stop in self.params.stop:
            # A stop string that ends in the new text starts at most len(stop) - 1 chars before it.
            start = max(len(text) - new_chars - len(stop) + 1, 0)
            index = text.find(stop, start)
            if index == -1:
                continue
            end = index + len(stop) if self.params.include_stop_str_in_output else index
            self.output_text = text[:end]
            self.stop_reason = stop
            return True
        return False

    def next_delta(self, finished: bool) -> str:
        """The text not yet streamed; while running, hold back what may begin a stop string."""
        limit = (
            len(self.output_text) if finished or self.stop_reason else len(self.output_text) - self._holdback
        )
        if limit <= self._sent:
            return ""
        delta = self.output_text[self._sent : limit]
        self._sent = limit
        return delta
