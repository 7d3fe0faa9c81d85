"""Build a server from a checkpoint and run it with uvicorn until SIGINT / SIGTERM.

Start-up loads the model through ``mlaq.LLM`` (so the MLAQ_FP8BMM / MLAQ_FP4BMM flags and
``--quantization-config`` apply as everywhere; the policy logs its one-line summary, and the per-layer
table at debug level). Shutdown is uvicorn's graceful one: stop accepting, let in-flight requests
finish for up to ``shutdown_timeout`` seconds, then cancel them (their clients see the stream end
with an error) and stop the engine thread.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.serve.config import ServeConfig, SpecMetricsMode

LOG = logging.getLogger("mlaq.serve")


@dataclass(frozen=True)
class EngineArgs:
    """What ``mlaq.LLM`` takes (vLLM's names)."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 16
    max_num_batched_tokens: int | None = None
    kv_cache_dtype: str = "auto"
    speculative_config: str | Mapping[str, Any] | None = None
    quantization_config: str | None = None
    quantization: str | None = None  # "online": targets mean vLLM's (the kv_b_proj linear)
    compile: bool = False
    compilation_config: str | Mapping[str, Any] | None = None
    seed: int = 0


def build_state(engine_args: EngineArgs, **serve: Any):
    """Load the model and wrap it: returns the ``ServerState`` ``build_app`` takes."""
    from mlaq.engine.llm import LLM
    from mlaq.serve.async_engine import AsyncEngine
    from mlaq.serve.metrics import ServerMetrics
    from mlaq.serve.state import ServerState

    llm = LLM(
        engine_args.model,
        dtype=engine_args.dtype,  # vLLM's names; LLM resolves them
        quantization_config=engine_args.quantization_config,
        quantization=engine_args.quantization,
        max_model_len=engine_args.max_model_len,
        max_num_seqs=engine_args.max_num_seqs,
        max_num_batched_tokens=engine_args.max_num_batched_tokens,
        kv_cache_dtype=engine_args.kv_cache_dtype,
        speculative_config=engine_args.speculative_config,
        compile=engine_args.compile,
        compilation_config=engine_args.compilation_config,
        seed=engine_args.seed,
    )
    _log_policy(llm)
    engine = llm.engine
    name = serve.pop("served_model_name", None) or engine_args.model
    mode = SpecMetricsMode(serve.pop("per_request_spec_decode_metrics", "none"))
    config = ServeConfig(
        served_model_name=name,
        model_path=str(engine_args.model),
        max_model_len=engine.config.max_model_len,
        spec_metrics=mode,
        **serve,
    )
    metrics = ServerMetrics(name, engine.k)
    return ServerState(
        config,
        AsyncEngine(engine, metrics, config.max_waiting),
        llm.tokenizer,
        metrics,
        engine.model.vocab_size,
        engine.k,
    )


def _log_policy(llm: Any) -> None:
    inner = getattr(llm.engine.model, "model", None)
    policy = getattr(inner, "policy", None)
    if policy is not None and LOG.isEnabledFor(logging.DEBUG):
        from mlaq.policy.report import format_explain

        LOG.debug("per-layer BMM decisions:\n%s", format_explain(policy, str(getattr(llm, "model_path", ""))))


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: an ephemeral port; read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or --host"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """A warning when ``host`` is reachable from other machines; louder with no API key."""
    if is_loopback(host):
        return
    if api_key is None:
        LOG.warning(
            "mlaq serve: listening on %s with NO API key: anyone who can reach this port can run the model "
            "and read /metrics; set --api-key or VLLM_API_KEY, or bind 127.0.0.1",
            host,
        )
    else:
        LOG.warning(
            "mlaq serve: listening on %s, reachable from other machines; the API key guards /v1 only "
            "(/health, /metrics, /tokenize, /detokenize, /tokenizer_info, /version stay open) and travels "
            "in clear text (no TLS)",
            host,
        )


def run_server(
    state: Any, sock: socket.socket, host: str, shutdown_timeout: float = 10.0, log_level: str = "info"
) -> int:
    """Serve on ``sock`` (from :func:`bind`) until SIGINT / SIGTERM; returns 0 after a clean stop."""
    import uvicorn

    from mlaq.serve.app import build_app

    actual = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(state),
        log_level=log_level,
        # the engine fails what is left after shutdown_timeout; those replies then end with an error event
        timeout_graceful_shutdown=shutdown_timeout + 5.0,
        access_log=False,
        lifespan="on",
    )
    server = _server_class()(config, state.engine, shutdown_timeout)
    LOG.info(
        "mlaq serve: %s on http://%s:%d (max_model_len %d)",
        state.config.served_model_name,
        host,
        actual,
        state.config.max_model_len,
    )
    server.run(sockets=[sock])
    LOG.info("mlaq serve: stopped")
    return 0


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server; on the first SIGINT / SIGTERM the engine gets ``grace`` seconds to finish
        in-flight requests, then fails the rest with an error the clients can read. A second signal
        fails them now (each stream still ends with its error event and ``[DONE]``, each plain reply is
        a JSON 503); only a third lets uvicorn drop the connections."""

        def __init__(self, config: Any, engine: Any, grace: float) -> None:
            super().__init__(config)
            self._engine, self._grace, self._timer, self._signals = engine, grace, None, 0

        def handle_exit(self, sig: int, frame: Any) -> None:
            self._signals += 1
            if self._signals == 1:
                LOG.info("mlaq serve: stopping (in-flight requests get %.0f s to finish)", self._grace)
                self._timer = threading.Timer(self._grace, self._engine.stop)
            elif self._signals == 2:
                LOG.info("mlaq serve: stopping now: in-flight requests end with an error")
                self._timer.cancel()
                self._timer = threading.Timer(0.0, self._engine.stop)  # not here: stop() joins a thread
            if self._signals <= 2:
                self._timer.daemon = True
                self._timer.start()
                self.should_exit = True
            else:
                super().handle_exit(sig, frame)
            # uvicorn re-raises captured signals on exit (status -15); a requested stop is a clean exit
            getattr(self, "_captured_signals", []).clear()

    return Server
