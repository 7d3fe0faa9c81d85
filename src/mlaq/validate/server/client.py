"""A small HTTP client for OpenAI-compatible servers: timeouts, bounded retries with backoff, one clear
message per failure.

Retried (up to ``retries`` times, waiting backoff x 2^attempt): connection failures and 429/502/503/504
(a busy or restarting server). Not retried: a timeout (a server that took ``timeout`` seconds will take
them again: the default, 180 s, fits a long prompt's first token, not a whole run), any other 4xx (the
request is wrong and will stay wrong) and 500 (a server bug: retrying hides it). While a request
waits, a "still waiting" line every ``WAIT_NOTE`` seconds says so (through the progress display, above
its bar). A page that is not JSON (an HTML error page, a web server that is not an OpenAI API) is
named in one line, never dumped. Every failure becomes a ``ServerError``
whose message names the server, the endpoint and what happened — never a traceback.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

RETRY_STATUS = frozenset({429, 502, 503, 504})
DEFAULT_TIMEOUT = 180.0  # seconds: a long prompt's first token on a busy server, not a whole run
WAIT_NOTE = 30.0  # seconds between "still waiting" lines


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
    timeout: float = DEFAULT_TIMEOUT  # seconds per request (a long-context prefill can be slow)
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


def not_json(response: Any) -> str:
    """One line for a reply that is not JSON: an HTML page by its title, other text by its first line."""
    text = response.text or ""
    kind = response.headers.get("content-type", "").split(";")[0].strip() or "no content type"
    if "html" in kind or text.lstrip()[:15].lower().startswith(("<!doctype", "<html")):
        m = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
        title = " ".join(m.group(1).split())[:100] if m else ""
        named = f" titled {title!r}" if title else ""
        return f"an HTML page{named}, not the OpenAI API: is this URL an OpenAI-compatible server (vLLM, SGLang, mlaq serve)?"
    first = " ".join(text.strip().splitlines()[:1])[:120]
    return f"{kind} text, not JSON ({first!r})" if first else f"an empty {kind} reply, not JSON"


def _error_text(response: Any) -> str:
    """The message of an OpenAI-shaped error body, else a one-line description of the body."""
    try:
        body = response.json()
    except (json.JSONDecodeError, ValueError):
        return not_json(response)
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

    def __init__(self, config: ClientConfig, note: Callable[[str], None] | None = None) -> None:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ValueError("mlaq validate --server needs httpx: pip install 'mlaq[remote]'") from exc
        self.config, self._note = config, note
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
            raise ServerError(f"{self.config.base}{path} answered {not_json(response)}") from None

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        httpx, cfg = self._httpx, self.config
        where = f"{cfg.base}{path}"
        last = ""
        for attempt in range(cfg.retries + 1):
            if attempt:
                time.sleep(cfg.backoff * 2 ** (attempt - 1))
            try:
                r = self._waiting(method, path, body, where)
            except httpx.TimeoutException:  # not retried: it would take as long again
                raise ServerError(
                    f"{method} {where}: no answer within {cfg.timeout:g} s (--timeout); a long prompt on a "
                    "busy server may need more: raise --timeout"
                ) from None
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

    def _waiting(self, method: str, path: str, body: dict[str, Any] | None, where: str) -> Any:
        """The request, with a "still waiting" note every WAIT_NOTE seconds until it answers."""
        if self._note is None:
            return self._client.request(method, path, json=body)
        done, start = threading.Event(), time.perf_counter()

        def remind() -> None:
            while not done.wait(WAIT_NOTE):
                waited = time.perf_counter() - start
                self._note(
                    f"still waiting for {where}: {waited:.0f} s of --timeout {self.config.timeout:g} s"
                )

        watcher = threading.Thread(target=remind, daemon=True)
        watcher.start()
        try:
            return self._client.request(method, path, json=body)
        finally:
            done.set()
