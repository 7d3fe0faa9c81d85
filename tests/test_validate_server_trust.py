"""``mlaq validate --server`` never reports a comparison of two different tokenizers as a result (A/B,
--against, --tokenizer: fingerprints compared before measuring), names the tokenizer when a server
refuses the ids, says in one line that a URL serves an HTML page, does not retry a timeout, and says
it is still waiting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlaq.bundled import bundled_model_dir
from mlaq.validate.server import ClientConfig, ServerError
from mlaq.validate.server import client as client_mod
from mlaq.validate.sources.server import run_server_validation
from server_fakes import VOCAB, Behaviour, FakeServer, Notes, _Handler, fake_config, write_text


@pytest.fixture
def text(tmp_path: Path) -> Path:
    return write_text(tmp_path)


_cfg = fake_config  # a small run against the fake server(s)


def _server(handler: type, behaviour: Behaviour | None = None) -> FakeServer:
    s = FakeServer(behaviour)
    s.httpd.RequestHandlerClass = handler
    return s


class Shifted(_Handler):
    """Another model's tokenizer: /tokenize maps text to other ids."""

    def do_POST(self) -> None:
        if self.path == "/tokenize":
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            return self._send(200, {"tokens": [(ord(ch) + 5) % VOCAB for ch in body["prompt"]]})
        return super().do_POST()


def _with_vocab(n: int) -> type:
    class Info(_Handler):
        def do_GET(self) -> None:
            if self.path == "/tokenizer_info":
                return self._send(200, {"vocab_size": n, "tokenizer_class": "fake"})
            return super().do_GET()

    return Info


class NoTokenizeStrictVocab(_Handler):
    """No /tokenize; ids past the vocabulary are a 400, as vLLM and mlaq serve answer."""

    def do_POST(self) -> None:
        if self.path == "/tokenize":
            return self._error(404, "Not Found")
        if self.path == "/v1/completions":
            n = int(self.headers["Content-Length"])
            body = json.loads(self.rfile.read(n))
            bad = [t for t in body["prompt"] if not 0 <= t < VOCAB]
            if bad:
                return self._error(
                    400, f"prompt: token ids {bad[:5]} are outside the vocabulary (size {VOCAB})."
                )
            b = self.server.behaviour
            return self._send(200, self._complete(b, body))
        return super().do_POST()


class Html(_Handler):
    """``python -m http.server``: every path an HTML page."""

    def _page(self) -> None:
        page = (
            b"<!DOCTYPE HTML>\n<html><head><title>Directory listing for /</title></head><body>" + b"x" * 2000
        )
        self.send_response(404 if self.path.startswith("/v1") else 200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def do_GET(self) -> None:
        self._page()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._page()


def test_an_ab_of_two_tokenizers_stops_before_measuring(text: Path) -> None:
    b = Behaviour()
    with (
        FakeServer(b) as a,
        _server(Shifted) as other,
        pytest.raises(ValueError, match=r"the tokenizers differ: .* probe text") as info,
    ):
        run_server_validation(_cfg(a, text, reference=ClientConfig(other, retries=0)))
    assert "\n" not in str(info.value) and b.requests == 0  # nothing measured


def test_different_vocabularies_stop_the_ab(text: Path) -> None:
    with (
        _server(_with_vocab(6144)) as a,
        _server(_with_vocab(4096)) as b,
        pytest.raises(ValueError, match="vocabularies of 6,144 and 4,096 tokens"),
    ):
        run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))


def test_the_same_tokenizer_passes(text: Path) -> None:
    with _server(_with_vocab(VOCAB)) as a, _server(_with_vocab(VOCAB), Behaviour(noise=0.3)) as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    assert r["schemes"]


def test_against_a_recording_of_another_tokenizer_stops(text: Path, tmp_path: Path) -> None:
    rec = tmp_path / "ref.safetensors"
    with FakeServer() as a:
        run_server_validation(_cfg(a, text, record=rec))
    with (
        _server(Shifted) as other,
        pytest.raises(ValueError, match=r"the tokenizers differ: .* and the recording .*ref\.safetensors"),
    ):
        run_server_validation(_cfg(other, text, against=rec))
    with FakeServer() as same:  # the recording's own tokenizer: fine
        assert run_server_validation(_cfg(same, text, against=rec))["schemes"]


def test_tokenizer_of_another_model_stops(text: Path) -> None:
    with FakeServer() as a, pytest.raises(ValueError, match=r"the tokenizers differ: .* and --tokenizer"):
        run_server_validation(_cfg(a, text, tokenizer=bundled_model_dir()))


def test_ids_outside_the_vocabulary_name_the_tokenizer(text: Path) -> None:
    tok = bundled_model_dir()
    with _server(NoTokenizeStrictVocab) as a, pytest.raises(ServerError) as info:
        run_server_validation(_cfg(a, text, tokenizer=tok))
    message = str(info.value)
    assert "outside the vocabulary" in message and f"made by --tokenizer {tok}" in message, message


def test_an_html_page_is_one_line(text: Path) -> None:
    with _server(Html) as a, pytest.raises(ServerError) as info:
        run_server_validation(_cfg(a, text))
    message = str(info.value)
    assert "an HTML page titled 'Directory listing for /', not the OpenAI API" in message, message
    assert "\n" not in message and "<html" not in message.lower() and len(message) < 300


def test_a_timeout_is_not_retried_and_the_default_fits_a_first_token(text: Path) -> None:
    assert ClientConfig("http://x").timeout == 180.0
    b = Behaviour(delay=0.6)
    with FakeServer(b) as a, pytest.raises(ServerError, match=r"no answer within 0.2 s"):
        run_server_validation(_cfg(a, text, timeout=0.2, retries=3))
    assert b.requests <= 1  # one completion tried, not four


def test_a_slow_server_gets_still_waiting_notes_through_the_progress(text: Path, monkeypatch) -> None:
    monkeypatch.setattr(client_mod, "WAIT_NOTE", 0.1)
    notes = Notes()
    with FakeServer(Behaviour(delay=0.35)) as a:
        run_server_validation(_cfg(a, text, windows=1, prompts=1), notes)
    assert notes.lines and all(line.startswith(f"still waiting for {a}") for line in notes.lines)
    assert "of --timeout 30 s" in notes.lines[0]


def test_the_plain_progress_prints_notes_on_their_own_line(capsys) -> None:
    from mlaq.progress import NullProgress, PlainProgress

    PlainProgress("validate").note("still waiting for x")
    NullProgress().note("still waiting for y")
    assert capsys.readouterr().err == "still waiting for x\nstill waiting for y\n"
