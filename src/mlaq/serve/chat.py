"""``POST /v1/chat/completions``: the checkpoint's chat template (tokenizer_config.json or
chat_template.jinja), then the same engine stream as completions; the non-streaming reply is the
folded stream. ``max_tokens`` (or ``max_completion_tokens``) defaults to what is left of max-model-len.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mlaq.engine.sampling_params import SamplingParams
from mlaq.serve.errors import bad_request
from mlaq.serve.logprobs import chat_logprobs
from mlaq.serve.params import check_logprobs, logit_bias, sampling_params, unsupported
from mlaq.serve.protocol import ChatCompletionRequest, ChatMessage
from mlaq.serve.state import ServerState, created_now, request_id
from mlaq.serve.streams import merge, spec_decoding_metrics, usage


@dataclass(frozen=True)
class ChatPlan:
    request: ChatCompletionRequest
    text: str
    token_ids: list[int]
    params: tuple[SamplingParams, ...]
    id: str
    created: int


def messages_json(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the template sees them; a list of content parts becomes its text parts joined."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            parts = [p.get("text", "") for p in m.content if p.get("type") == "text"]
            if len(parts) != len(m.content):
                raise bad_request("only text content parts are supported.", "messages")
            d["content"] = "".join(parts)
        out.append(d)
    return out


def render(
    state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict | None
) -> tuple[str, list[int]]:
    tokenizer = state.need_tokenizer("chat")
    try:
        text = tokenizer.apply_chat_template(messages_json(messages), add_generation_prompt, **(kwargs or {}))
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


def plan(req: ChatCompletionRequest, state: ServerState) -> ChatPlan:
    state.check_model(req.model)
    unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
    check_logprobs("top_logprobs", req.top_logprobs, state.config)
    text, ids = render(state, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    if not ids:
        raise bad_request("the chat template rendered an empty prompt.", "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    bias = logit_bias(req, state.vocab_size)
    params = tuple(
        sampling_params(req, len(ids), max_tokens, logprobs, state.config, seed_offset=j, bias=bias)
        for j in range(req.n)
    )
    return ChatPlan(req, text, ids, params, request_id("chatcmpl"), created_now())


async def chunks(plan: ChatPlan, state: ServerState) -> AsyncIterator[dict[str, Any]]:
    req = plan.request
    name = state.config.served_model_name
    head = {"id": plan.id, "object": "chat.completion.chunk", "created": plan.created, "model": name}
    streams = [state.engine.generate(plan.token_ids, p, plan.text) for p in plan.params]
    for j in range(req.n):  # vLLM: the role comes first, on its own
        yield {
            **head,
            "choices": [
                {
                    "index": j,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    generated, finals = [0] * req.n, {}
    async for j, out in merge(streams):
        c = out.outputs[0]
        generated[j] += len(c.token_ids)
        logprobs = None
        if req.logprobs and c.logprobs is not None:
            n = req.top_logprobs or 0
            content = chat_logprobs(
                c.token_ids, c.logprobs, n, state.token_text, req.return_tokens_as_token_ids
            )
            logprobs = {"content": content}
        if out.finished:
            finals[j] = out
        choice = {
            "index": j,
            "delta": {"content": c.text},
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        yield {**head, "choices": [choice]}
    last: dict[str, Any] = {**head, "choices": [], "usage": usage(len(plan.token_ids), sum(generated))}
    if len(finals) == 1:
        spec = spec_decoding_metrics(finals[0], state.num_spec_tokens, state.config.spec_metrics)
        if spec is not None:
            last["metrics"] = {"speculative_decoding": spec}
    yield last
