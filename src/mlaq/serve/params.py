"""Request fields -> ``SamplingParams``, with every check that needs the server's limits.

Range checks are ``SamplingParams``' own (its messages begin with the field's name, which becomes
the error's ``param``); the server adds what depends on it: max-model-len, --max-logprobs, n,
logit_bias's vocabulary and clamp, and the OpenAI fields mlaq does not implement (a 400 naming
them, rather than silently ignoring them).
"""

from __future__ import annotations

from mlaq.engine.sampling_params import SamplingParams
from mlaq.serve.config import ServeConfig
from mlaq.serve.errors import APIError, bad_request
from mlaq.serve.protocol import ChatCompletionRequest, CompletionRequest

MAX_N = 16


def check_logprobs(name: str, value: int | None, config: ServeConfig) -> None:
    if value is None:
        return
    limit = config.max_logprobs
    if value == -1 and limit == -1:
        return
    if value < 0 or (limit != -1 and value > limit):
        whole = " (-1 = the whole vocabulary needs the server started with --max-logprobs -1)"
        raise bad_request(f"{name} must be between 0 and {limit}{whole}, got {value}.", name)


def unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    field = req.unsupported_field()
    if field is not None:
        raise bad_request(
            f"{field} is not supported by mlaq serve: it generates plain text only (no tool calls, "
            "no structured or guided output); remove the field.",
            field,
        )
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {req.n}.", "n")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix is not supported by mlaq serve.", "suffix")
        if req.best_of not in (None, req.n):
            raise bad_request(f"best_of must equal n ({req.n}) in mlaq serve, got {req.best_of}.", "best_of")


def logit_bias(req: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> dict[int, float] | None:
    """The request's logit_bias as vLLM's server reads it: keys are token ids written as strings,
    biases clamped to [-100, 100] (OpenAI's range); an id outside the vocabulary is a 400."""
    if not req.logit_bias:
        return None
    bias, bad = {}, []
    for key, value in req.logit_bias.items():
        try:
            bias[int(key)] = min(100.0, max(-100.0, value))
        except ValueError:
            bad.append(key)
    if bad:
        raise bad_request(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}", "logit_bias"
        )
    outside = sorted(t for t in bias if not 0 <= t < vocab_size)
    if outside:
        raise bad_request(
            f"logit_bias: token_id(s) {outside[:5]} contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            "logit_bias",
        )
    return bias


def sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_tokens: int | None,
    logprobs: int | None,
    config: ServeConfig,
    seed_offset: int = 0,
    bias: dict[int, float] | None = None,
) -> SamplingParams:
    """The params of one choice of one prompt of ``prompt_len`` tokens."""
    room = config.max_model_len - prompt_len
    if room <= 0 and not (max_tokens == 0 and prompt_len <= config.max_model_len):
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens (max_tokens {max_tokens}); shorten the prompt.",
            "prompt",
        )
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {config.max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion "
            "(max_tokens)). Reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=0 if req.top_k is None else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=None if req.seed is None else req.seed + seed_offset,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
            frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
            logit_bias=bias,
            skip_special_tokens=req.skip_special_tokens,
        )
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise APIError(400, message, param if param.isidentifier() else None) from None
