"""Every error the server returns, built in one place, in OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status as ``code`` (as vLLM does).

Handlers turn request-validation failures into 400s that name the field, and anything unexpected into
a 500 that says so without a traceback in the reply (the log has it).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

LOG = logging.getLogger("mlaq.serve")

TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error reply: raise it anywhere below a route."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    kind = TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate, escaped
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    # a union reports every member it tried: the error that is not a type mismatch says what was wrong
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    # pydantic puts the union member tried into the location ("stop", "str"): keep the field path
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    what = f"{param}: " if param else ""
    value = first.get("input")
    shown = f" (got {value!r})" if param and not isinstance(value, dict) and len(repr(value)) < 80 else ""
    msg = str(first.get("msg", "")).removeprefix("Value error, ")
    return f"{what}{msg}{shown}", param


_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "function-after", "constrained-str"}


def _is_type_tag(x: object) -> bool:
    return isinstance(x, str) and (x in _TAGS or "[" in x or x.startswith("constrained-"))


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        LOG.exception("internal error while serving a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}")
