"""``SamplingParams``: what one request asks of the sampler, with vLLM's field names and checks.

The fields mean what they mean in vLLM's ``SamplingParams``; a value vLLM rejects is rejected here
with a message that says what was wrong. Differences, on purpose: ``n`` is not supported (one
completion per prompt; the server submits n requests), and ``logprobs=True`` is accepted as
``logprobs=0`` (only the chosen token's logprob). ``logprobs`` / ``prompt_logprobs`` of -1 mean the
whole vocabulary (vLLM's convention when its ``--max-logprobs`` is -1). ``max_tokens=0`` computes the
prompt (for ``prompt_logprobs``) and generates nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# vLLM treats a temperature below this as greedy (its _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes (signed or unsigned 64 bits)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request.

    >>> SamplingParams(temperature=0).greedy
    True
    >>> SamplingParams(stop="\\n\\n").stop
    ('\\n\\n',)
    """

    temperature: float = 1.0  # 0 (below 1e-5) = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    seed: int | None = None  # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16  # None = up to max_model_len; 0 = prompt only (prompt_logprobs)
    min_tokens: int = 0  # no EOS / stop token / stop string before this many output tokens
    stop: tuple[str, ...] = field(default=())  # str or list accepted; excluded from the output
    stop_token_ids: tuple[int, ...] = field(default=())
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; N = the chosen token's plus the top N; -1 = all
    prompt_logprobs: int | None = None  # per prompt token (after the first): its logprob plus the top N
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output (vLLM's)
    presence_penalty: float = 0.0  # in [-2, 2]: minus this from every token already in the OUTPUT
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the OUTPUT
    # token id -> bias added to its logit; a dict is accepted and kept as sorted (id, bias) pairs
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Normalise the convenient spellings first (frozen: write through object.__setattr__).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, 0 if getattr(self, name) else None)
        self._validate()
        if self.greedy:
            # As vLLM does: greedy ignores the truncation knobs, so normalise them to "off".
            object.__setattr__(self, "top_k", 0)
            object.__setattr__(self, "top_p", 1.0)
            object.__setattr__(self, "min_p", 0.0)
        elif self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

    def _validate(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature!r}.")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise ValueError(f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k!r}.")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(
                f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (a 64-bit seed) or None, "
                f"got {self.seed!r}."
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 0):
            raise ValueError(f"max_tokens must be at least 0, got {self.max_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be at least 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be less than or equal to max_tokens ({self.max_tokens})."
            )
        if not _is_number(self.repetition_penalty) or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty!r}.")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty!r}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}.")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}.")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise ValueError(
                    f"{name} must be non-negative, or -1 for the whole vocabulary, got {value!r}."
                )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax (temperature below vLLM's epsilon)."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        """True when the logits are adjusted before sampling: a penalty, min_tokens or logit_bias."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 when there is none)."""
        return max((len(s) for s in self.stop), default=0)

    @classmethod
    def from_dict(cls, values: dict[str, object]) -> SamplingParams:
        """Build from a JSON-like dict, naming any unknown key (vLLM's request fields)."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}")
        return cls(**values)  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs. Keys may be ints or strings of ints (the JSON
    form, as vLLM converts them); a key that is neither, a negative id or a non-finite bias is refused."""
    if bias is None:
        return ()
    items = list(bias.items()) if isinstance(bias, Mapping) else list(bias)  # type: ignore[call-overload]
    pairs: dict[int, float] = {}
    bad_keys = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"logit_bias must map token ids to biases, got {bias!r}.")
        key, value = item
        try:
            token = key if _is_int(key) else int(key) if isinstance(key, str) else None
        except ValueError:
            token = None
        if token is None:
            bad_keys.append(key)
            continue
        if token < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {token}.")
        if not _is_number(value) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {token}.")
        pairs[token] = float(value)
    if bad_keys:
        raise ValueError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad_keys!r}"
        )
    return tuple(sorted(pairs.items()))


def as_params_list(params: SamplingParams | Sequence[SamplingParams], n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: a single one is shared, a list must match the prompts."""
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; pass one, or one per prompt")
    return params
