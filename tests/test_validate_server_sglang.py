"""mlaq validate --server against a fake SGLang 0.5.23 server: the server kind detected once, teacher
forcing and generation through its native /generate (token ids, not its OpenAI API's text keys), MTP
acceptance from meta_info, and the report naming the API of each measurement."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlaq.validate.server import ClientConfig
from mlaq.validate.server.client import ServerError
from mlaq.validate.server.sglang import generate_body, parse_teacher_forced
from mlaq.validate.sources.server import run_server_validation
from server_fakes import Behaviour, FakeServer, write_text
from server_fakes import fake_config as _cfg
from server_fakes_sglang import SglangBehaviour, SglangServer
from test_validate_server import _cand, _srv


@pytest.fixture
def text(tmp_path: Path) -> Path:
    return write_text(tmp_path)


def test_sglang_against_an_equal_vllm_shaped_server_gives_zero_kl(text: Path) -> None:
    sg = SglangBehaviour()
    with SglangServer(sg) as a, FakeServer(Behaviour()) as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    c, s = _cand(r), _srv(r)
    assert c["kl"] == 0.0 and c["top1_agreement"] == 1.0 and c["nll_delta"] == 0.0
    assert c["generation"]["identical_generations"] == 3
    assert s["kind"] == "sglang" and s["version"] == "0.5.23" and s["max_model_len"] == 512
    assert s["teacher_forcing"].startswith("SGLang /generate")
    assert s["apis"]["generation"].startswith("SGLang /generate")
    assert _srv(r, "reference")["kind"] == "openai"
    assert sg.completions_requests == 0 and sg.generate_requests > 0  # never its text-keyed OpenAI API


def test_sglang_candidate_kl_matches_the_same_noise_on_vllm(text: Path) -> None:
    """The same perturbed model behind SGLang's API and behind vLLM's gives the same figures."""
    with SglangServer(SglangBehaviour(noise=1.0)) as a, FakeServer(Behaviour()) as ref:
        sg = run_server_validation(_cfg(a, text, reference=ClientConfig(ref, retries=0)))
    with FakeServer(Behaviour(noise=1.0)) as a, FakeServer(Behaviour()) as ref:
        vl = run_server_validation(_cfg(a, text, reference=ClientConfig(ref, retries=0)))
    assert _cand(sg)["kl"] > 0
    for key in ("kl", "top1_agreement", "nll_delta"):
        assert _cand(sg)[key] == pytest.approx(_cand(vl)[key], rel=1e-12), key


def test_acceptance_from_meta_info(text: Path) -> None:
    with SglangServer(SglangBehaviour(spec_k=3, per_request=True)) as a:
        r = run_server_validation(_cfg(a, text))
    with FakeServer(Behaviour(spec_k=3, per_request=True)) as a:
        v = run_server_validation(_cfg(a, text))
    assert _srv(r)["acceptance_source"] == "per_request" and _srv(r)["apis"]["acceptance"].startswith(
        "SGLang"
    )
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length"):
        assert r["reference"][key] == v["reference"][key], key
    assert r["reference"]["num_accepted_tokens_per_pos"] == ()  # SGLang reports no per-position counts


def test_teacher_forcing_shape_errors_are_one_line() -> None:
    tokens = [1, 2, 3]
    short = {"meta_info": {"input_token_logprobs": [[None, 1, None]], "input_top_logprobs": [None]}}
    with pytest.raises(ServerError, match="returned 1 input token logprobs for a prompt of 3 tokens"):
        parse_teacher_forced(short, tokens)
    wrong = {
        "meta_info": {
            "input_token_logprobs": [[None, 1, None], [-1.0, 9, None], [-1.0, 3, None]],
            "input_top_logprobs": [None, [[-1.0, 9, None]], [[-1.0, 3, None]]],
        }
    }
    with pytest.raises(ServerError, match="scored token 9 at prompt position 1, not 2"):
        parse_teacher_forced(wrong, tokens)
    with pytest.raises(ServerError, match="no whole distribution"):
        generate_body(tokens, 1, -1, prompt_logprobs=True)


def test_sglang_error_body_reaches_the_user() -> None:
    from mlaq.validate.server.client import HttpClient

    with (
        SglangServer() as a,
        HttpClient(ClientConfig(a, retries=0)) as client,
        pytest.raises(ServerError, match=r"HTTP 400: .*input_ids: expected a list of integers"),
    ):
        client.post_json("/generate", {"text": "hello"})


def test_report_names_the_api_of_each_measurement() -> None:
    from mlaq.validate.report_sections import _server

    line = _server(
        {"model": "m", "url": "u", "kind": "sglang", "apis": {"teacher_forcing": "SGLang /generate (x)"}}
    )
    assert "teacher forcing via SGLang /generate (x)" in line
