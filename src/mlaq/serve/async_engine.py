"""The engine loop behind the server: one thread steps ``LLMEngine`` while the event loop serves HTTP.

Requests from every connection go into the same engine and share its decode steps (continuous
batching; no lock around ``generate``). The thread takes new requests and aborts between steps, runs
one step, and hands each request its delta on the event loop (one ``call_soon_threadsafe`` per step).
Abort drops the request from the scheduler and frees its cache blocks before the next step.
Latencies and counters are recorded here, where the tokens appear, with vLLM's definitions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from mlaq.engine.engine import LLMEngine
from mlaq.engine.outputs import RequestOutput
from mlaq.engine.sampling_params import SamplingParams
from mlaq.libc import heap_trimmer
from mlaq.serve.errors import APIError
from mlaq.serve.metrics import ServerMetrics

LOG = logging.getLogger("mlaq.serve")


class EngineStopped(Exception):
    """The server is shutting down (or the engine failed): the request cannot finish."""


@dataclass(eq=False)
class _Stream:
    token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    engine_id: str | None = None
    first_token: float | None = None
    last_token: float | None = None
    generated: int = 0
    finished: bool = False


class AsyncEngine:
    """Owns the engine thread; ``generate`` is the only way in."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_waiting: int) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._cond = threading.Condition()
        self._inbox: list[_Stream] = []
        self._aborts: list[_Stream] = []
        self._live: dict[str, _Stream] = {}
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mlaq-engine", daemon=True)
        self.steps = 0
        self._trim = heap_trimmer()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; every unfinished request gets ``EngineStopped``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return len(self._inbox) + self.engine.num_waiting

    @property
    def failed(self) -> bool:
        return self._error is not None

    def check_capacity(self, count: int) -> None:
        """503 when the server is stopping or ``count`` more requests would overfill the waiting queue."""
        if self._stopping or self._error is not None:
            raise APIError(503, "the server is shutting down" if self._stopping else "the engine loop failed")
        if self.num_waiting + count > self.max_waiting:
            raise APIError(
                503,
                f"too many waiting requests ({self.num_waiting} waiting, {count} more asked, --max-waiting "
                f"{self.max_waiting}); retry later",
            )

    async def generate(
        self, token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request as the engine makes them; closing the iterator early aborts it."""
        if self._stopping or self._error is not None:
            raise APIError(503, "the server is shutting down")
        stream = _Stream(list(token_ids), params, prompt, asyncio.get_running_loop())
        with self._cond:
            self._inbox.append(stream)
            self._cond.notify()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream)

    def abort(self, stream: _Stream) -> None:
        with self._cond:
            stream.finished = True
            self._aborts.append(stream)
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        trimmed_at = 0
        try:
            while True:
                with self._cond:
                    trim = self._trim is not None and trimmed_at != self.steps and not self._has_work()
                    while not trim and not self._has_work():
                        self._cond.wait()
                if trim:  # idle after work: hand the freed heap pages back (heap_trimmer), unlocked
                    trimmed_at = self.steps
                    self._trim(0)
                    continue
                with self._cond:
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                self._admit(inbox)
                self._abort(aborts)
                if self.engine.has_unfinished_requests:
                    self._step()
                else:
                    self._observe([])
        except Exception as exc:  # an engine bug must not hang clients: fail them all, log it
            LOG.exception("the engine loop failed")
            self._error = exc
        self._fail_all(EngineStopped("the server stopped before this request finished"))

    def _has_work(self) -> bool:
        return bool(self._inbox or self._aborts or self._stopping or self.engine.has_unfinished_requests)

    def _admit(self, inbox: list[_Stream]) -> None:
        for s in inbox:
            if s.finished:  # aborted before it reached the engine
                continue
            try:
                s.engine_id = self.engine.add_request(s.token_ids, s.params, s.prompt)
            except ValueError as exc:
                s.finished = True
                self._deliver([(s, APIError(400, str(exc)))])
                continue
            self._live[s.engine_id] = s

    def _abort(self, aborts: list[_Stream]) -> None:
        for s in aborts:
            if s.engine_id is not None and self._live.pop(s.engine_id, None) is not None:
                self.engine.abort(s.engine_id)
                self.metrics.success.labels(self.metrics.labels["model_name"], "abort").inc()

    def _step(self) -> None:
        outputs = self.engine.step()
        self.steps += 1
        now = time.perf_counter()
        batch: list[tuple[_Stream, RequestOutput | BaseException]] = []
        for out in outputs:
            s = self._live.get(out.request_id)
            if s is None:
                continue
            self._record(s, out, now)
            if out.finished:
                del self._live[out.request_id]
                s.finished = True
            batch.append((s, out))
        self._observe(outputs)
        self._deliver(batch)

    def _record(self, s: _Stream, out: RequestOutput, now: float) -> None:
        m, name = self.metrics, self.metrics.labels["model_name"]
        n = len(out.outputs[0].token_ids)
        if s.first_token is None and (n or out.finished):
            m.prompt_tokens.labels(name).inc(len(s.token_ids))
            if n:
                m.ttft.labels(name).observe(now - s.arrival)
                s.first_token = now
        elif n and s.last_token is not None:
            m.itl.labels(name).observe(now - s.last_token)
        if n:
            s.last_token = now
            s.generated += n
            m.generation_tokens.labels(name).inc(n)
        if out.finished:
            m.e2e.labels(name).observe(now - s.arrival)
            if s.generated > 1 and s.first_token is not None:
                m.tpot.labels(name).observe((now - s.first_token) / (s.generated - 1))
            m.success.labels(name, out.outputs[0].finish_reason or "stop").inc()

    def _observe(self, outputs: list[RequestOutput]) -> None:
        e = self.engine
        if outputs:
            self.metrics.batch.labels(self.metrics.labels["model_name"]).observe(len(outputs))
        self.metrics.observe_engine(e.num_running, e.num_waiting, e.kv_cache_usage, e.spec_decoding_stats)

    def _deliver(self, batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for s, item in batch:
            by_loop.setdefault(s.loop, []).append((s.queue, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening any more
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            pending = [s for s in self._inbox if not s.finished] + list(self._live.values())
            self._inbox, self._live = [], {}
        for s in pending:
            s.finished = True
        self._deliver([(s, exc) for s in pending])


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
