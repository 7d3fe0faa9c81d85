"""ASGI middleware in front of every route: the API key (401) and the body size limit (413).

As vLLM: with ``--api-key`` every ``/v1`` route needs ``Authorization: Bearer KEY``; /health,
/metrics, /version and the tokenizer routes stay open. A body over the limit is refused from its
Content-Length before it is read, and a chunked one as soon as it passes the limit.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlaq.serve.errors import error_body


class BodyTooLarge(HTTPException):
    """An HTTPException, so that FastAPI's body parser re-raises it as it is (a 413, not a 400)."""


class Guard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await _reply(send, 401, "Unauthorized: send the API key as 'Authorization: Bearer KEY'.")
                return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _reply(send, 413, _too_large(int(length), self.max_body))
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(413, _too_large(seen, self.max_body))
            return message

        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge as exc:
            if not started:
                await _reply(send, 413, str(exc.detail))


def _too_large(size: int, limit: int) -> str:
    return f"request body of {size} bytes is over the server's limit of {limit} bytes (--max-body-bytes)."


async def _reply(send: Send, status: int, message: str) -> None:
    body = json.dumps(error_body(status, message)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
