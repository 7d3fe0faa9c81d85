"""``POST /v1/completions``: one producer of stream chunks; the non-streaming reply is those chunks
folded (``streams.fold``, shared with chat), so both replies come from one code path.

Prompts: a string, a list of strings, a list of token ids, or a list of such lists; each gets ``n``
choices (index = prompt * n + j; choice j > 0 of a seeded request uses seed + j). ``echo`` puts the
prompt in front of the text (and, with ``logprobs``, the prompt tokens' logprobs in front of the
completion's: the first token has none), which is what lm-eval's loglikelihood reads; vLLM's
``prompt_logprobs`` returns them in its own format. ``max_tokens: 0`` with echo scores a prompt only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mlaq.engine.sampling_params import SamplingParams
from mlaq.serve.errors import bad_request
from mlaq.serve.logprobs import completion_logprobs, prompt_logprobs
from mlaq.serve.params import check_logprobs, logit_bias, sampling_params, unsupported
from mlaq.serve.protocol import CompletionRequest
from mlaq.serve.state import ServerState, created_now, request_id
from mlaq.serve.streams import merge, spec_decoding_metrics, usage


@dataclass(frozen=True)
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class CompletionPlan:
    """A validated request: what to submit, and how to render it."""

    request: CompletionRequest
    prompts: tuple[_Prompt, ...]
    params: tuple[SamplingParams, ...]  # one per choice
    id: str
    created: int


def _prompts(req: CompletionRequest, state: ServerState) -> list[_Prompt]:
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], str)):
        texts = [p] if isinstance(p, str) else p
        tokenizer = state.need_tokenizer("a text prompt")
        out = [_Prompt(t, tokenizer.encode(t)) for t in texts]
    else:
        lists = [p] if not p or isinstance(p[0], int) else p
        out = []
        for ids in lists:
            state.check_token_ids(ids, "prompt")
            text = state.tokenizer.decode(ids, skip_special_tokens=False) if state.tokenizer else None
            out.append(_Prompt(text, list(ids)))
    if not out or any(not x.token_ids for x in out):
        raise bad_request("prompt must not be empty (give text or at least one token id).", "prompt")
    return out


def plan(req: CompletionRequest, state: ServerState) -> CompletionPlan:
    state.check_model(req.model)
    unsupported(req)
    check_logprobs("logprobs", req.logprobs, state.config)
    check_logprobs("prompt_logprobs", req.prompt_logprobs, state.config)
    if req.echo and req.stream and req.prompt_logprobs is not None:
        raise bad_request(
            "prompt_logprobs is not available with stream; use echo with logprobs.", "prompt_logprobs"
        )
    prompts = _prompts(req, state)
    bias = logit_bias(req, state.vocab_size)
    params = []
    for pr in prompts:
        for j in range(req.n):
            sp = sampling_params(
                req, len(pr.token_ids), req.max_tokens, req.logprobs, state.config, seed_offset=j, bias=bias
            )
            if req.echo and req.logprobs is not None and sp.prompt_logprobs is None:
                sp = _with_prompt_logprobs(sp, req.logprobs)
            params.append(sp)
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise bad_request("max_tokens 0 returns nothing unless echo or prompt_logprobs is set.", "max_tokens")
    return CompletionPlan(req, tuple(prompts), tuple(params), request_id("cmpl"), created_now())


def _with_prompt_logprobs(sp: SamplingParams, n: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sp, prompt_logprobs=n)


async def chunks(plan: CompletionPlan, state: ServerState) -> AsyncIterator[dict[str, Any]]:
    """Stream chunks: one per delta of each choice, then one with usage (and per-request metrics)."""
    req, n = plan.request, plan.request.n
    name = state.config.served_model_name
    as_ids = req.return_tokens_as_token_ids
    streams = []
    for i, pr in enumerate(plan.prompts):
        for j in range(n):
            streams.append(state.engine.generate(pr.token_ids, plan.params[i * n + j], pr.text))
    offsets = [0] * len(streams)
    first = [True] * len(streams)
    generated = [0] * len(streams)
    finals = {}
    async for index, out in merge(streams):
        pr, c = plan.prompts[index // n], out.outputs[0]
        text, block = c.text, None
        choice: dict[str, Any] = {"index": index}
        if first[index]:
            first[index] = False
            if req.echo:
                text = (pr.text or "") + text
            if out.prompt_logprobs is not None and req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(
                    pr.token_ids, out.prompt_logprobs, state.token_text, as_ids
                )
            if req.echo and req.logprobs is not None:
                entries = out.prompt_logprobs or (None,) * len(pr.token_ids)
                block, offsets[index] = completion_logprobs(
                    pr.token_ids, entries, req.logprobs, state.token_text, as_ids, 0
                )
        if req.logprobs is not None and c.logprobs is not None:
            more, offsets[index] = completion_logprobs(
                c.token_ids, c.logprobs, req.logprobs, state.token_text, as_ids, offsets[index]
            )
            block = more if block is None else {k: block[k] + more[k] for k in block}
        elif req.logprobs is not None and block is None:
            block = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        generated[index] += len(c.token_ids)
        choice.update(text=text, logprobs=block, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        if out.finished:
            finals[index] = out
        yield {
            "id": plan.id,
            "object": "text_completion",
            "created": plan.created,
            "model": name,
            "choices": [choice],
        }
    last: dict[str, Any] = {
        "id": plan.id,
        "object": "text_completion",
        "created": plan.created,
        "model": name,
        "choices": [],
        "usage": usage(sum(len(p.token_ids) for p in plan.prompts), sum(generated)),
    }
    if len(finals) == 1:
        spec = spec_decoding_metrics(finals[0], state.num_spec_tokens, state.config.spec_metrics)
        if spec is not None:
            last["metrics"] = {"speculative_decoding": spec}
    yield last
