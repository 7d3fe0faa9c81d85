"""Every error class of ``mlaq serve`` in OpenAI's shape (never a traceback, never a 500), and a clean
stop on SIGTERM with a request in flight."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402

from conftest import SRC  # noqa: E402
from serve_helpers import chat_checkpoint, serving  # noqa: E402

KEY = "sekret"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("serve_err"), mtp=False)


@pytest.fixture(scope="module")
def server(ckpt):
    with serving(
        ckpt, {"max_model_len": 32}, served_model_name="tiny", api_key=KEY, max_body_bytes=2048
    ) as s:
        yield s


def post(server, path: str, body: dict | str, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(
        server.url + path, content=content, headers={**headers, "content-type": "application/json"}
    )


def error_of(r: httpx.Response, status: int, param: str | None = "any") -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    if param != "any":
        assert err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be at least 0"),
        ({"temperature": -0.5}, "temperature", "temperature must be non-negative"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ({"top_k": -3}, "top_k", "top_k"),
        ({"min_p": 2}, "min_p", "min_p"),
        ({"logprobs": 21}, "logprobs", "between 0 and 20"),
        ({"max_tokens": "ten"}, "max_tokens", "integer"),
        ({"stop": 3}, "stop", ""),
        ({"n": 0}, "n", "n must be"),
        ({"prompt": ""}, "prompt", "must not be empty"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": [5, 100000]}, "prompt", "outside the vocabulary"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 1e999}, "repetition_penalty", "finite"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "cannot be converted to integer token IDs: ['abc']"),
        ({"logit_bias": {"100000": 1}}, "logit_bias", "out-of-vocab token ids. Vocabulary size"),
        ({"logit_bias": {"-1": 1}}, "logit_bias", "out-of-vocab"),
        ({"logit_bias": {"3": "x"}}, "logit_bias.3", ""),
        ({"repetition_penalty": 0}, "repetition_penalty", "greater than zero"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "min_tokens"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(server, extra, param, words):
    message = error_of(
        post(server, "/v1/completions", {"prompt": "the cat", "max_tokens": 4, **extra}), 400, param
    )
    assert words in message


def test_prompt_plus_max_tokens_over_max_model_len_names_both_numbers(server):
    n = len(httpx.post(server.url + "/tokenize", json={"prompt": "the cat sat"}).json()["tokens"])
    message = error_of(
        post(server, "/v1/completions", {"prompt": "the cat sat", "max_tokens": 40}), 400, "max_tokens"
    )
    assert "32" in message and f"{n} in the prompt" in message and "40" in message
    long = list(range(3, 40))  # longer than max-model-len by itself
    assert "32" in error_of(post(server, "/v1/completions", {"prompt": long, "max_tokens": 1}), 400, "prompt")


def test_chat_errors(server):
    assert "top_logprobs" in error_of(
        post(
            server,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        ),
        400,
        "top_logprobs",
    )
    error_of(post(server, "/v1/chat/completions", {"messages": []}), 400, "messages")
    error_of(
        post(server, "/v1/chat/completions", {"messages": [{"content": "no role"}]}), 400, "messages.0.role"
    )


def test_unknown_model_is_404_bad_json_is_400(server):
    assert "nope" in error_of(post(server, "/v1/completions", {"model": "nope", "prompt": "a"}), 404, "model")
    error_of(post(server, "/v1/completions", "{not json"), 400)
    error_of(httpx.get(server.url + "/no/such/route"), 404)


def test_api_key_is_required_on_v1_only(server):
    error_of(post(server, "/v1/completions", {"prompt": "a"}, key=None), 401)
    error_of(post(server, "/v1/completions", {"prompt": "a"}, key="wrong"), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # open, as in vLLM
    assert httpx.get(server.url + "/metrics").status_code == 200
    client = openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert openai.OpenAI(base_url=server.v1, api_key=KEY).models.list().data[0].id == "tiny"


def test_body_over_the_limit_is_413(server):
    message = error_of(post(server, "/v1/completions", {"prompt": "the " * 1000}), 413)
    assert "2048" in message


def test_full_waiting_queue_is_503(ckpt):
    with serving(ckpt, {"max_model_len": 32}, max_waiting=0) as s:
        r = httpx.post(s.v1 + "/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert "--max-waiting 0" in error_of(r, 503)
        with pytest.raises(openai.APIStatusError) as info:
            openai.OpenAI(base_url=s.v1, api_key="x", max_retries=0).completions.create(
                model=s.state.config.served_model_name, prompt="a"
            )
        assert info.value.status_code == 503


def test_sigterm_stops_cleanly_with_a_request_in_flight(ckpt):
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "mlaq", "serve", str(ckpt), "--port", "0", "--shutdown-timeout", "1"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        else:
            pytest.fail("server did not start:\n" + "".join(lines))
        for line in proc.stderr:  # until uvicorn says it is up
            lines.append(line)
            if "startup complete" in line:
                break
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "the", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        client = threading.Thread(target=stream)
        client.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
        client.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines) + rest
    assert proc.returncode == 0, log
    assert "Traceback" not in log
    assert events[-1] == "data: [DONE]"  # the stream ended properly ...
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["error"]["code"] == 503 and "stopped" in last["error"]["message"]  # ... with an error event
