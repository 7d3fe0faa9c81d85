"""A small HTTP client for OpenAI-compatible servers: timeouts, bounded retries with backoff, one clear
message per failure.

Retried (up to ``retries`` times, waiting backoff x 2^attempt): connection failures, timeouts, and
429/502/503/504 (a busy or restarting server). Not retried: any other 4xx (the request is wrong and
will stay wrong) and 500 (a server bug: retrying hides it). Every failure becomes a ``ServerError``
whose message names the server, the endpoint and what happened — never a traceback.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

RETRY_STATUS = frozenset({429, 502, 503, 504})


class ServerError(ValueError):
    """A server could not answer a request (a ValueError, so the CLI prints it as one line)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Unsupported(ServerError):
    """The server lacks what one measurement needs; the other measurements still run."""


@dataclass(frozen=True)
class ClientConfig:
    url: str  # base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)
    api_key: str | None = None
    timeout: float = 600.0  # seconds per request (a long-context prefill can be slow)
    retries: int = 3
    backoff: float = 0.5  # seconds before the first retry

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"server URL {self.url!r} must start with http:// or https://")
        if self.timeout <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")

    @property
    def base(self) -> str:
        """The server root, without a trailing slash or /v1."""
        return self.url.rstrip("/").removesuffix("/v1")


def _error_text(response: Any) -> str:
    """The message of an OpenAI-shaped error body, else the start of the body."""
    try:
        body = response.json()
    except (json.JSONDecodeError, ValueError):
        return response.text[:300].strip() or response.reason_phrase
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(body.get("detail"), str):
            return body["detail"]
        if isinstance(body.get("message"), str):
            return body["message"]
    return json.dumps(body)[:300]


class HttpClient:
    """Thread-safe (one ``httpx.Client``); use as a context manager or call ``close``."""

    def __init__(self, config: ClientConfig) -> None:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError("mlaq validate --server needs httpx: pip install 'mlaq[remote]'") from exc
        self.config = config
        self._httpx = httpx
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._client = httpx.Client(base_url=config.base, headers=headers, timeout=config.timeout)

    def __enter__(self) -> HttpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()

    def get(self, path: str) -> Any:
        """GET ``path``; the httpx response (a 2xx) or ServerError."""
        return self._request("GET", path, None)

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("POST", path, body)

    def get_json(self, path: str) -> Any:
        return self._json(self.get(path), path)

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return self._json(self.post(path, body), path)

    def _json(self, response: Any, path: str) -> Any:
        try:
            return response.json()
        except (json.JSONDecodeError, ValueError):
            raise ServerError(
                f"{self.config.base}{path} did not answer JSON: {response.text[:200]!r}"
            ) from None

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        httpx, cfg = self._httpx, self.config
        where = f"{cfg.base}{path}"
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.backoff * 2 ** (attempt - 1))
            try:
                r = self._client.request(method, path, json=body)
            except httpx.TimeoutException:
                last = f"{method} {where} timed out after {cfg.timeout:g} s (raise --timeout)"
                continue
            except httpx.ConnectError as exc:
                last = f"cannot connect to {cfg.base} ({exc}); is the server running at that URL?"
                continue
            except httpx.HTTPError as exc:
                last = f"{method} {where} failed: {exc}"
                continue
            if r.status_code < 400:
                return r
            msg = f"{method} {where} answered HTTP {r.status_code}: {_error_text(r)}"
            if r.status_code in RETRY_STATUS:
                last = msg
                continue
            if r.status_code == 401:
                msg += " (pass the server's key with --api-key)"
            raise ServerError(msg, r.status_code)
        tries = f" (after {cfg.retries + 1} attempts)" if cfg.retries else ""
        raise ServerError(last + tries)
