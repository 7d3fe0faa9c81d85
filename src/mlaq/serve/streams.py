"""Pieces shared by completions and chat: merging the choices' streams, SSE framing, usage, and
vLLM's per-request speculative-decoding metrics."""

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
