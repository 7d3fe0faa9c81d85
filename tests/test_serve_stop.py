"""``mlaq serve``'s flags are checked before the model loads (one line naming the flag), the API key is
never silently empty and may come from VLLM_API_KEY, and a double Ctrl-C ends every stream with an
error event (no traceback, no plain-text 500)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
import httpx

from conftest import SRC, run_mlaq
from serve_helpers import chat_checkpoint


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--port", "99999"], "--port must be from 0"),
        (["--port", "-1"], "--port must be from 0"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1, got 0"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least 1"),
        (["--shutdown-timeout", "-5"], "--shutdown-timeout must be a number of seconds >= 0, got -5"),
        (["--shutdown-timeout", "nan"], "--shutdown-timeout"),
        (["--max-waiting", "-1"], "--max-waiting must be at least 0"),
        (["--api-key", ""], "--api-key is empty"),
    ],
)
def test_bad_flags_are_one_line_before_the_model_loads(tmp_path, flags, words):
    # MODEL does not exist: a flag checked before loading is what the one line names
    r = run_mlaq("serve", str(tmp_path / "no-such-model"), *flags, env={"VLLM_API_KEY": ""})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], r.stderr


def test_an_empty_vllm_api_key_is_refused():
    r = run_mlaq("serve", "/no/such/model", env={"VLLM_API_KEY": "  "})
    assert r.returncode == 2 and "VLLM_API_KEY is empty" in r.stderr, r.stderr


def test_api_key_comes_from_vllm_api_key_and_the_flag_wins():
    from mlaq.settings import serve_api_key

    assert serve_api_key(None, {"VLLM_API_KEY": "env-key"}) == "env-key"
    assert serve_api_key("flag-key", {"VLLM_API_KEY": "env-key"}) == "flag-key"
    assert serve_api_key(None, {}) is None
    with pytest.raises(ValueError, match="--api-key is empty"):
        serve_api_key("", {"VLLM_API_KEY": "env-key"})


def test_a_port_in_use_is_one_line_before_the_model_loads(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = run_mlaq("serve", str(tmp_path / "no-such-model"), "--port", str(port))
    assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize(
    ("host", "key", "words"),
    [
        ("0.0.0.0", None, "NO API key"),
        ("192.168.1.5", "k", "guards /v1 only"),
        ("127.0.0.1", None, None),
        ("::1", None, None),
        ("localhost", None, None),
    ],
)
def test_binding_beyond_loopback_warns_louder_without_a_key(caplog, host, key, words):
    from mlaq.serve.server import warn_if_exposed

    with caplog.at_level(logging.WARNING, logger="mlaq.serve"):
        warn_if_exposed(host, key)
    if words is None:
        assert not caplog.records
    else:
        assert len(caplog.records) == 1 and words in caplog.records[0].getMessage()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("serve_stop"), mtp=False)


def _start(ckpt) -> tuple[subprocess.Popen, int, list[str]]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mlaq", "serve", str(ckpt), "--port", "0", "--shutdown-timeout", "30"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    port = None
    for line in proc.stderr:
        lines.append(line)
        m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        port = int(m.group(1)) if m else port
        if "startup complete" in line:
            return proc, port, lines
    proc.kill()
    pytest.fail("server did not start:\n" + "".join(lines))


def _wait_running(port: int, n: int, timeout: float = 60.0) -> None:
    """Until the server's vllm:num_requests_running gauge reaches n."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        running = [
            float(x.split()[-1]) for x in text.splitlines() if x.startswith("vllm:num_requests_running")
        ]
        if running and running[0] >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"fewer than {n} requests running after {timeout} s")


def test_double_ctrl_c_ends_every_request_with_an_error_and_no_traceback(ckpt):
    proc, port, lines = _start(ckpt)
    url = f"http://127.0.0.1:{port}/v1/completions"
    long = {"prompt": "the", "max_tokens": 4000, "ignore_eos": True}
    events: list[str] = []
    plain: list[httpx.Response] = []
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    def folded() -> None:
        plain.append(httpx.post(url, json=long, timeout=60))

    clients = [threading.Thread(target=stream), threading.Thread(target=folded)]
    try:
        for c in clients:
            c.start()
        assert started.wait(60)
        _wait_running(port, 2)  # both requests in the batch before the first Ctrl-C, not still connecting
        proc.send_signal(signal.SIGINT)
        threading.Event().wait(0.5)
        proc.send_signal(signal.SIGINT)  # the impatient second Ctrl-C: stop now, not in 30 s
        rest = proc.communicate(timeout=25)[1]
        for c in clients:
            c.join(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log
    assert "Traceback" not in log and "ERROR" not in log, log
    assert events[-1] == "data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == 503 and "stopped" in last["error"]["message"]
    assert plain and plain[0].status_code == 503, plain
    assert plain[0].json()["error"]["code"] == 503
