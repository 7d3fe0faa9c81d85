"""A client's mistake is a 4xx naming the field, never a 500: text that is not Unicode, numbers that are
not finite, a seed past 64 bits, template kwargs that collide with the request, features mlaq does not
implement (refused, not ignored); ``created`` is the request's time, not the server's start."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
import httpx

from serve_helpers import chat_checkpoint, serving

CHAT = {"messages": [{"role": "user", "content": "the cat"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpt = chat_checkpoint(tmp_path_factory.mktemp("serve_trust"), mtp=False)
    with serving(ckpt, {"max_model_len": 32}, served_model_name="tiny") as s:
        yield s


def post(server, path: str, body: str) -> httpx.Response:
    """``body`` as raw JSON text, so that it can hold what ``json.dumps`` never writes (NaN, \\ud800)."""
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})


def error_of(r: httpx.Response, param: str | None) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param", "words"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt", "lone surrogate (U+D800)"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt.1", "lone surrogate"),
        ("/v1/completions", '{"prompt": "a", "stop": "\\ud800"}', "stop", "lone surrogate"),
        ("/tokenize", '{"prompt": "\\ud800"}', "prompt", "lone surrogate"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages.0.content",
            "lone surrogate",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
            "messages.0",
            "lone surrogate",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a", "name": "\\ud800"}]}',
            "messages.0",
            "lone surrogate",
        ),
        ("/v1/completions", '{"prompt": "a", "temperature": Infinity}', "temperature", "finite"),
        ("/v1/completions", '{"prompt": "a", "top_p": NaN}', "top_p", "finite"),
        ("/v1/completions", '{"prompt": "a", "logit_bias": {"3": NaN}}', "logit_bias.3", "finite"),
        ("/v1/completions", '{"prompt": "a", "seed": 18446744073709551616}', "seed", "9223372036854775807"),
        ("/v1/completions", '{"prompt": "a", "seed": -9223372036854775809}', "seed", "greater than"),
    ],
)
def test_text_and_numbers_a_tokenizer_or_sampler_cannot_take_are_400(server, path, body, param, words):
    assert words in error_of(post(server, path, body), param)


def test_a_64_bit_seed_is_accepted(server):
    r = post(
        server, "/v1/completions", '{"prompt": "the", "max_tokens": 1, "seed": 9223372036854775807, "n": 2}'
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token"])
def test_chat_template_kwargs_may_not_replace_the_requests_own_fields(server, key):
    body = {**CHAT, "chat_template_kwargs": {key: []}}
    message = error_of(post(server, "/v1/chat/completions", json.dumps(body)), "chat_template_kwargs")
    assert key in message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("response_format", {"type": "json_object"}),
        ("guided_json", {"type": "object"}),
        ("guided_choice", ["a", "b"]),
        ("guided_regex", "a+"),
        ("structured_outputs", {"choice": ["a"]}),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_features_are_refused_by_name(server, path, field, value):
    base = CHAT if "chat" in path else {"prompt": "the cat", "max_tokens": 2}
    message = error_of(post(server, path, json.dumps({**base, field: value})), field)
    assert f"{field} is not supported" in message


def test_fields_that_ask_for_nothing_unsupported_are_accepted(server):
    body = {**CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}
    assert post(server, "/v1/chat/completions", json.dumps(body)).status_code == 200


def test_created_is_the_requests_time(server):
    time.sleep(1.1)  # the fixture's server started at least a second before this request
    before = int(time.time())
    r = post(server, "/v1/completions", json.dumps({"prompt": "the", "max_tokens": 1}))
    assert before <= r.json()["created"] <= int(time.time())
    r = post(server, "/v1/chat/completions", json.dumps(CHAT))
    assert before <= r.json()["created"] <= int(time.time())
    with httpx.stream(
        "POST", server.url + "/v1/completions", json={"prompt": "the", "max_tokens": 1, "stream": True}
    ) as s:
        first = json.loads(next(line for line in s.iter_lines() if line).removeprefix("data: "))
    assert first["created"] >= before


@pytest.mark.parametrize("name", ["mlaq-tiny-4k", "mlaq-tiny"])
def test_the_bundled_models_ship_a_chat_template(name):
    from mlaq.bundled import bundled_model_dir
    from mlaq.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(bundled_model_dir(name))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "# user: hi\n# assistant:\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
