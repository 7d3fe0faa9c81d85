"""Pieces shared by completions and chat: merging the choices' streams, folding a stream into the
non-streaming reply, SSE framing, usage, and vLLM's per-request speculative-decoding metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from mlaq.engine.outputs import RequestOutput
from mlaq.serve.config import SpecMetricsMode


async def merge(streams: Sequence[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, delta) from every stream as they come; closing this closes (aborts) them all."""
    if len(streams) == 1:  # the common case: no tasks
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except Exception as exc:  # re-raised by the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def fold(chunks: list[dict[str, Any]], obj: str) -> dict[str, Any]:
    """The non-streaming reply (``object`` = ``obj``): every chunk of the stream added up, choice by
    choice. Chat's ``delta`` becomes its ``message``; the last chunk brings usage (and metrics)."""
    choices: dict[int, Any] = {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            choices[ch["index"]] = _add(choices.get(ch["index"]), ch)
    last = chunks[-1]
    folded = [{("message" if k == "delta" else k): v for k, v in choices[i].items()} for i in sorted(choices)]
    reply = {"id": last["id"], "object": obj, "created": last["created"], "model": last["model"]}
    reply |= {"choices": folded, "usage": last["usage"]}
    if "metrics" in last:
        reply["metrics"] = last["metrics"]
    return reply


def _add(acc: Any, more: Any) -> Any:
    """One chunk's choice added to what came before: text and lists (tokens, logprobs, offsets)
    concatenate, objects merge field by field, a null never erases a value, any other value (index,
    finish_reason, stop_reason: sent once) is taken as it comes."""
    if acc is None:
        return more
    if more is None:
        return acc
    if (isinstance(acc, str) and isinstance(more, str)) or (isinstance(acc, list) and isinstance(more, list)):
        return acc + more
    if isinstance(acc, dict) and isinstance(more, dict):
        return {k: _add(acc.get(k), more.get(k)) for k in {**acc, **more}}
    return more


def stream_chunk(chunk: dict[str, Any], include_usage: bool) -> dict[str, Any] | None:
    """What the SSE stream sends of a chunk: usage only when asked (stream_options.include_usage)."""
    if chunk["choices"]:
        body = {k: v for k, v in chunk.items() if k != "usage"}
        return {**body, "usage": None} if include_usage else body  # usage only in the final chunk, when asked
    if include_usage:
        return chunk
    if "metrics" in chunk:  # the per-request speculative metrics, without the usage nobody asked for
        return {k: v for k, v in chunk.items() if k != "usage"}
    return None


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def spec_decoding_metrics(
    final: RequestOutput, num_spec_tokens: int, mode: SpecMetricsMode
) -> dict[str, Any] | None:
    """vLLM's ``metrics.speculative_decoding`` of one finished request (None when not asked)."""
    if mode is SpecMetricsMode.NONE or not num_spec_tokens or final.spec_steps is None:
        return None
    steps = final.spec_steps
    drafted = sum(k for k, _ in steps)
    accepted = sum(n for _, n in steps)
    histogram = [0] * (num_spec_tokens + 1)
    for _, n in steps:
        histogram[n] += 1
    per_pos = [sum(1 for _, n in steps if n > i) for i in range(num_spec_tokens)]
    out: dict[str, Any] = {
        "mean_acceptance_length": 1.0 + accepted / len(steps) if steps else 1.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": accepted,
        "num_draft_tokens": drafted,
        "num_spec_tokens": num_spec_tokens,
        "num_accepted_tokens_per_pos": per_pos,  # mlaq: vLLM's per-position counter, per request
    }
    if mode is SpecMetricsMode.DETAILED:
        out["per_step_accepted"] = [n for _, n in steps]
        out["per_step_drafted"] = [k for k, _ in steps]
    return out
