"""The FastAPI application: routes of vLLM's OpenAI-compatible server over an ``AsyncEngine``.

``build_app(state)`` wires the routes; starting and stopping the engine thread is the lifespan's job.
A streaming reply is server-sent events ending in ``data: [DONE]``; an error after the stream began
is sent as one more event in OpenAI's error shape. A client that goes away aborts its requests:
streaming replies are cancelled by Starlette on disconnect, non-streaming ones are watched here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mlaq import __version__
from mlaq.serve import chat, completions
from mlaq.serve.async_engine import EngineStopped
from mlaq.serve.errors import APIError, error_body, install_handlers
from mlaq.serve.guard import Guard
from mlaq.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from mlaq.serve.state import ServerState
from mlaq.serve.streams import SSE_DONE, fold, sse, stream_chunk


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine.stop)

    app = FastAPI(title="mlaq serve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(Guard, api_key=state.config.api_key, max_body_bytes=state.config.max_body_bytes)
    app.state.mlaq = state

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, raw: Request) -> Response:
        plan = completions.plan(req, state)
        state.engine.check_capacity(len(plan.params))
        include = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _stream(completions.chunks(plan, state), lambda c: stream_chunk(c, include))
        return await _folded(raw, completions.chunks(plan, state), "text_completion")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, raw: Request) -> Response:
        plan = chat.plan(req, state)
        state.engine.check_capacity(len(plan.params))
        include = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _stream(chat.chunks(plan, state), lambda c: stream_chunk(c, include))
        return await _folded(raw, chat.chunks(plan, state), "chat.completion")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages.", "prompt")
        tokenizer = state.need_tokenizer("tokenize")
        if req.messages is not None:  # the chat template already holds its special tokens
            text, _ = chat.render(state, req.messages, req.add_generation_prompt, None)
            ids = tokenizer.encode(text, add_special_tokens=bool(req.add_special_tokens))
        else:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=add)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": state.config.max_model_len, "tokens": ids}
        out["token_strs"] = [state.token_text(t, False) for t in ids] if req.return_token_strs else None
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(req.model)
        state.check_token_ids(req.tokens, "tokens")
        return {"prompt": state.need_tokenizer("detokenize").decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        tok = state.need_tokenizer("tokenizer_info")
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": None,
            "eos_token_ids": list(tok.eos_token_ids),
            "vocab_size": tok.vocab_size,
            "model_max_length": state.config.max_model_len,
            "chat_template": tok.chat_template,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = state.config.served_model_name
        card = {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "mlaq",
            "root": state.config.model_path,
            "parent": None,
            "max_model_len": state.config.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> Response:
        if state.engine.failed:
            return JSONResponse(
                error_body(503, "the engine loop failed; see the server log"), status_code=503
            )
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__, "engine": "mlaq"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _stream(
    chunks: AsyncIterator[dict[str, Any]], wire: Callable[[dict[str, Any]], dict[str, Any] | None]
) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                out = wire(chunk)
                if out is not None:
                    yield sse(out)
        except APIError as exc:
            yield sse(exc.body())
        except EngineStopped as exc:
            yield sse(error_body(503, str(exc)))
        finally:
            await chunks.aclose()  # aborts what is still running (client gone, or an error)
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")


async def _folded(
    raw: Request,
    chunks: AsyncIterator[dict[str, Any]],
    obj: str,
) -> Response:
    async def collect() -> list[dict[str, Any]]:
        try:
            return [c async for c in chunks]
        finally:
            await chunks.aclose()

    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_disconnected(raw.receive))
    await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    if not work.done():  # the client left: abort its requests, answer nobody
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=499)
    gone.cancel()
    try:
        return JSONResponse(fold(work.result(), obj))
    except EngineStopped as exc:
        raise APIError(503, str(exc)) from None


async def _disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
