"""A small fake OpenAI-compatible server (stdlib http.server on 127.0.0.1, an ephemeral port) for the
``mlaq validate --server`` client tests: a deterministic toy "model" over a 32-token vocabulary, with
switches for each capability and failure a real server may lack or show."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from mlaq.progress import NullProgress
from mlaq.validate.server import ClientConfig, ServerValidateConfig
from mlaq.validate.shape import RunShape

VOCAB = 32


@dataclass
class Behaviour:
    name: str = "fake"
    noise: float = 0.0  # perturbation of the logits (a "quantized" candidate)
    max_model_len: int = 512
    tokenize: bool = True
    prompt_logprobs: bool = True  # vLLM's extra
    echo_logprobs: bool = True
    text_keys: bool = False  # top_logprobs keyed by token text (OpenAI) instead of token_id:N
    max_logprobs: int = 20  # -1 allowed when >= VOCAB
    fail_status: int | None = None  # every completion answers this status
    delay: float = 0.0  # seconds before answering completions
    spec_k: int = 0  # emulate MTP with k drafts
    per_request: bool = False  # add metrics.speculative_decoding to responses
    extra_requests: int = 0  # other traffic counted in vllm:request_success_total per greedy request
    counters: dict[str, float] = field(default_factory=dict)
    requests: int = 0


def logprobs(prefix: list[int], noise: float) -> np.ndarray:
    """log-softmax of a deterministic function of the last two tokens and the position."""
    a, b = (prefix[-1], prefix[-2] if len(prefix) > 1 else 0)
    rng = np.random.default_rng(1000 * a + 37 * b + len(prefix) % 7)
    z = 3.0 * rng.standard_normal(VOCAB)
    if noise:
        z = z + noise * np.random.default_rng(7 + 1000 * a + len(prefix)).standard_normal(VOCAB)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def _top(lp: np.ndarray, k: int, actual: int | None) -> dict[int, float]:
    n = VOCAB if k == -1 else k
    idx = np.argsort(-lp, kind="stable")[:n]
    out = {int(i): float(lp[i]) for i in idx}
    if actual is not None:
        out[actual] = float(lp[actual])
    return out


class _Handler(BaseHTTPRequestHandler):
    server: Any

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: Any, text: bool = False) -> None:
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(
            status, {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
        )

    def do_GET(self) -> None:
        b: Behaviour = self.server.behaviour
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": b.name, "max_model_len": b.max_model_len}]})
        elif self.path == "/version":
            self._send(200, {"version": "fake-0.1"})
        elif self.path == "/metrics":
            lines = [
                f'vllm:request_success_total{{model_name="{b.name}",finished_reason="length"}} {b.requests}'
            ]
            if b.spec_k:
                c = b.counters
                for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                    lines.append(f'vllm:spec_decode_{key}_total{{model_name="{b.name}"}} {c.get(key, 0.0)}')
                for i in range(b.spec_k):
                    lines.append(
                        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{b.name}",position="{i}"}} '
                        f"{c.get(f'pos{i}', 0.0)}"
                    )
            self._send(200, "# HELP x\n" + "\n".join(lines) + "\n", text=True)
        else:
            self._error(404, "not found")

    def do_POST(self) -> None:
        b: Behaviour = self.server.behaviour
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            if not b.tokenize:
                return self._error(404, "Not Found")
            return self._send(200, {"tokens": [ord(ch) % VOCAB for ch in body["prompt"]]})
        if self.path != "/v1/completions":
            return self._error(404, "not found")
        if b.delay:
            time.sleep(b.delay)
        if b.fail_status:
            return self._error(b.fail_status, "simulated failure")
        for v in (body.get("logprobs"), body.get("prompt_logprobs")):
            too_many = v is not None and b.max_logprobs != -1 and (v == -1 or v > b.max_logprobs)
            if too_many:
                return self._error(
                    400, f"Requested logprobs of {v}, which is greater than max allowed: {b.max_logprobs}"
                )
        self._send(200, self._complete(b, body))

    def _complete(self, b: Behaviour, body: dict[str, Any]) -> dict[str, Any]:
        prompt: list[int] = body["prompt"]
        k = body.get("logprobs")
        plp = body.get("prompt_logprobs") if b.prompt_logprobs else None
        tokens: list[int] = []
        seq = list(prompt)
        sampler = np.random.default_rng(body.get("seed")) if body.get("temperature") else None
        for _ in range(body.get("max_tokens", 16)):
            lp = logprobs(seq, b.noise)  # temperature 1 when sampling (all the client asks for)
            t = (
                int(np.argmax(lp))
                if sampler is None
                else int(sampler.choice(VOCAB, p=np.exp(lp) / np.exp(lp).sum()))
            )
            tokens.append(t)
            seq.append(t)
        b.requests += 1 + b.extra_requests
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(chr(65 + t) for t in tokens),
            "finish_reason": "length",
        }
        key = (lambda t: chr(65 + t)) if b.text_keys else (lambda t: f"token_id:{t}")
        if plp is not None:
            choice["prompt_logprobs"] = [None] + [
                {
                    str(t): {"logprob": v, "rank": 1}
                    for t, v in _top(logprobs(prompt[:i], b.noise), plp, prompt[i]).items()
                }
                for i in range(1, len(prompt))
            ]
        if body.get("echo") and k is not None and b.echo_logprobs:
            full = prompt + tokens
            tops = [None] + [
                {key(t): v for t, v in _top(logprobs(full[:i], b.noise), k, full[i]).items()}
                for i in range(1, len(full))
            ]
            lps = [None] + [float(logprobs(full[:i], b.noise)[full[i]]) for i in range(1, len(full))]
            choice["logprobs"] = {
                "tokens": [key(t) for t in full],
                "token_logprobs": lps,
                "top_logprobs": tops,
            }
        elif k is not None and not body.get("echo"):
            full = prompt + tokens
            tops = [
                {key(t): v for t, v in _top(logprobs(full[:i], b.noise), k, full[i]).items()}
                for i in range(len(prompt), len(full))
            ]
            choice["logprobs"] = {"tokens": [key(t) for t in tokens], "top_logprobs": tops}
        out: dict[str, Any] = {"object": "text_completion", "model": b.name, "choices": [choice]}
        if b.spec_k and not body.get("echo") and body.get("prompt_logprobs") is None:
            out["metrics"] = self._spec(b, len(tokens))
        return out

    def _spec(self, b: Behaviour, n: int) -> dict[str, Any] | None:
        # a fixed acceptance pattern: steps accept 2, 0, 1, 2, 0, 1 ... drafts (k >= 2)
        hist = [0] * (b.spec_k + 1)
        emitted = 0
        step = 0
        while emitted < n:
            acc = min((2, 0, 1)[step % 3], b.spec_k)
            hist[acc] += 1
            emitted += acc + 1
            step += 1
        c = b.counters
        c["num_drafts"] = c.get("num_drafts", 0) + step
        c["num_draft_tokens"] = c.get("num_draft_tokens", 0) + step * b.spec_k
        c["num_accepted_tokens"] = c.get("num_accepted_tokens", 0) + sum(i * h for i, h in enumerate(hist))
        for i in range(b.spec_k):
            c[f"pos{i}"] = c.get(f"pos{i}", 0) + sum(h for a, h in enumerate(hist) if a > i)
        if not b.per_request:
            return None
        return {
            "speculative_decoding": {
                "num_spec_tokens": b.spec_k,
                "num_spec_steps": step,
                "num_draft_tokens": step * b.spec_k,
                "num_accepted_draft_tokens": sum(i * h for i, h in enumerate(hist)),
                "acceptance_histogram": hist,
            }
        }


class FakeServer:
    """``with FakeServer(Behaviour(...)) as url: ...``"""

    def __init__(self, behaviour: Behaviour | None = None) -> None:
        self.behaviour = behaviour or Behaviour()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.behaviour = self.behaviour  # type: ignore[attr-defined]
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


# the --server tests' shared setup: an evaluation text, the config of a small run, a progress stub
TEXT = "".join(f"line {i}: value = {i * 7 % 13} + {i % 5}\n" for i in range(200))
_SHAPE = {f.name for f in fields(RunShape)}


def write_text(folder: Path) -> Path:
    path = folder / "eval.txt"
    path.write_text(TEXT)
    return path


def server_config(server: ClientConfig, **kw: Any) -> ServerValidateConfig:
    """``ServerValidateConfig`` whose ``kw`` mixes the run shape's fields (windows, eval_text, tasks, ...)
    and the server config's own (reference, logprobs, ...)."""
    shape = RunShape(**{k: v for k, v in kw.items() if k in _SHAPE})
    return ServerValidateConfig(
        server=server, shape=shape, **{k: v for k, v in kw.items() if k not in _SHAPE}
    )


def fake_config(url: str, text: Path, **kw: Any) -> ServerValidateConfig:
    """A small run against the fake server(s): no retries unless asked, a short backoff."""
    client = ClientConfig(url, timeout=kw.pop("timeout", 30.0), retries=kw.pop("retries", 0), backoff=0.01)
    base = dict(eval_text=text, context_len=48, windows=2, buckets=3, prompts=3, prompt_len=16, max_tokens=12)
    return server_config(client, **{**base, "concurrency": 2, **kw})


class Notes(NullProgress):
    """A silent progress that keeps the notes (``still waiting ...``) instead of printing them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def note(self, line: str) -> None:
        self.lines.append(line)
