"""``mlaq serve`` through the real ``openai`` client on 127.0.0.1: greedy equals ``mlaq.LLM``, the
stream folds to the reply, chat, echo + logprobs equal the teacher-forced log-softmax, tokenizer
routes, /metrics counters (spec decode equal to the engine's own), continuous batching, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import torch  # noqa: E402

from mlaq.engine.llm import LLM  # noqa: E402
from mlaq.engine.sampling_params import SamplingParams  # noqa: E402
from serve_helpers import MTP, chat_checkpoint, scrape, serving  # noqa: E402

PROMPTS = ["the cat", "a dog ran in", "latent attention"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return chat_checkpoint(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="module")
def server(ckpt):
    with serving(
        ckpt,
        {"speculative_config": MTP, "max_model_len": 128},
        served_model_name="tiny",
        per_request_spec_decode_metrics="detailed",
        max_logprobs=-1,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), max_model_len=128)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def ids_of(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def metrics(server) -> dict[str, float]:
    return scrape(httpx.get(server.url + "/metrics").text)


def test_greedy_completions_equal_llm_generate_token_for_token(client, llm):
    r = client.completions.create(
        model="tiny", prompt=PROMPTS, max_tokens=10, temperature=0, logprobs=0,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    want = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ref in zip(r.choices, want, strict=True):
        assert ids_of(choice.logprobs.tokens) == list(ref.outputs[0].token_ids)
        assert choice.text == ref.outputs[0].text and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 30
    assert r.usage.prompt_tokens == sum(len(llm.tokenizer.encode(p)) for p in PROMPTS)
    ids = llm.tokenizer.encode(PROMPTS[1])  # token-id prompts give the same tokens
    r2 = client.completions.create(
        model="tiny", prompt=ids, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r2.choices[0].text == want[1].outputs[0].text


def test_penalties_and_logit_bias_equal_llm_generate(client, llm):
    kw = {"presence_penalty": 1.5, "frequency_penalty": 0.7, "logit_bias": {"5": 3.0, "9": -100.0}}
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True, "repetition_penalty": 1.4}
    r = client.completions.create(
        model="tiny", prompt="the cat", max_tokens=12, temperature=0, logprobs=0, extra_body=extra, **kw
    )
    sp = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.4,
        presence_penalty=1.5, frequency_penalty=0.7, logit_bias={5: 3.0, 9: -100.0},
    )  # fmt: skip
    want = llm.generate(["the cat"], sp)[0].outputs[0].token_ids
    plain = llm.generate(["the cat"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    got = ids_of(r.choices[0].logprobs.tokens)
    assert got == list(want) and got != list(plain[0].outputs[0].token_ids) and 9 not in got
    forced = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logit_bias={"7": 500},
        extra_body={"ignore_eos": True},
    )  # fmt: skip  (500 is clamped to 100, as vLLM does: still forces token 7)
    assert forced.choices[0].message.content == llm.tokenizer.decode([7] * 5)


def test_stream_deltas_concatenate_to_the_reply_and_carry_usage(client):
    kw = {"model": "tiny", "prompt": "the cat sat", "max_tokens": 12, "temperature": 0, "stop": [" the"]}
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    no_usage = list(client.completions.create(**kw, stream=True))
    assert all(c.usage is None for c in no_usage)  # no usage chunk unless asked
    # a chunk without choices carries only the per-request speculative metrics this server is started with
    assert all(c.choices or (c.model_extra or {}).get("metrics") for c in no_usage)


def test_seeded_sampling_n_choices(client):
    kw = {"model": "tiny", "prompt": "a dog", "max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 2}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert [c.index for c in a.choices] == [0, 1]
    assert a.usage.completion_tokens == 12 or all(
        c.finish_reason == "stop" for c in a.choices if c.finish_reason != "length"
    )


def test_chat_equals_llm_chat_and_streams_the_same(client, llm):
    messages = [{"role": "user", "content": "the dog"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    ref = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert len(r.choices[0].logprobs.content) == len(ref.outputs[0].token_ids)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_echo_logprobs_equal_the_teacher_forced_log_softmax(client, server, ckpt, llm):
    from mlaq.model import AttnPath, load_model
    from mlaq.model.layers.cache import ModelCache

    text = "the cat sat on the mat"
    ids = llm.tokenizer.encode(text)
    r = client.completions.create(
        model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert ids_of(lp.tokens) == ids and lp.token_logprobs[0] is None and r.choices[0].text == text
    model = load_model(ckpt)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), ModelCache(), path=AttnPath.NAIVE).logits[0]
    want = torch.log_softmax(logits.float(), -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-5, rtol=0)
    # lm-eval's loglikelihood request (max_tokens 1): the prompt part is the same
    r1 = client.completions.create(
        model="tiny", prompt=text, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    assert r1.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs
    # vLLM's prompt_logprobs, and the whole distribution (exact KL) with --max-logprobs -1
    raw = httpx.post(
        server.v1 + "/completions", json={"prompt": text, "max_tokens": 0, "prompt_logprobs": -1}
    ).json()
    plp = raw["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids) and len(plp[1]) == server.state.vocab_size
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(lp.token_logprobs[1], abs=1e-6)
    total = sum(torch.tensor([v["logprob"] for v in plp[1].values()]).exp().tolist())
    assert total == pytest.approx(1.0, abs=1e-4)


def test_tokenizer_routes_models_health_version(server, llm):
    text = "latent attention caches tokens"
    tok = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()
    assert tok["tokens"] == llm.tokenizer.encode(text) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 128
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == llm.tokenizer.encode("<user>hi<assistant>", add_special_tokens=False)
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<eos>" and "<assistant>" in info["chat_template"]
    models = httpx.get(server.v1 + "/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["engine"] == "mlaq"


def test_metrics_counters_move_by_the_right_amounts(client, server):
    before = metrics(server)
    r = client.completions.create(
        model="tiny", prompt="the cat sat", max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(server)

    def moved(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("vllm:prompt_tokens_total") == r.usage.prompt_tokens
    assert moved("vllm:generation_tokens_total") == r.usage.completion_tokens == 9
    assert moved('vllm:request_success_total{finished_reason="length"}') == 1
    assert moved("vllm:time_to_first_token_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:inter_token_latency_seconds_count") >= 1
    # spec decode: the per-request metrics are the counters' movement, and /metrics is the engine's stats
    spec = r.model_extra["metrics"]["speculative_decoding"]
    assert moved("vllm:spec_decode_num_drafts_total") == spec["num_spec_steps"] > 0
    assert moved("vllm:spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert moved("vllm:spec_decode_num_accepted_tokens_total") == spec["num_accepted_draft_tokens"]
    for i, n in enumerate(spec["num_accepted_tokens_per_pos"]):
        assert moved(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') == n
    assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] == len(spec["per_step_accepted"])
    stats = server.state.engine.engine.spec_decoding_stats
    assert after["vllm:spec_decode_num_drafts_total"] == stats.num_drafts
    assert after["vllm:spec_decode_num_accepted_tokens_total"] == stats.num_accepted_tokens
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_the_engine_thread_trims_the_heap_once_when_it_goes_idle(client, server):
    calls: list[tuple[int, int]] = []
    engine = server.state.engine
    real, engine._trim = engine._trim, lambda pad: calls.append((pad, engine.steps)) or 1
    try:
        client.completions.create(model="tiny", prompt="the cat", max_tokens=4, temperature=0)
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert calls == [(0, engine.steps)]  # once, after the last step; not again while idle
    finally:
        engine._trim = real


def test_concurrent_requests_share_decode_steps(server):
    before = metrics(server)

    async def many() -> list:
        async with openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0) as c:
            jobs = [
                c.completions.create(
                    model="tiny", prompt=p, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
                )
                for p in PROMPTS * 2
            ]
            return await asyncio.gather(*jobs)

    replies = asyncio.run(many())
    after = metrics(server)
    assert all(r.usage.completion_tokens == 24 for r in replies)
    steps = after["mlaq:step_batch_size_count"] - before["mlaq:step_batch_size_count"]
    single = after['mlaq:step_batch_size_bucket{le="1.0"}'] - before['mlaq:step_batch_size_bucket{le="1.0"}']
    assert steps - single > 0  # some engine steps ran several requests together
    assert steps < 6 * 24  # fewer steps than one request at a time would need


def test_client_disconnect_aborts_and_frees_blocks(server):
    before = metrics(server)
    body = {
        "model": "tiny",
        "prompt": "the",
        "max_tokens": 100,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as c, c.stream("POST", server.v1 + "/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.monotonic() + 30
    while True:  # the engine thread handles the abort between steps
        now = metrics(server)
        if now['vllm:request_success_total{finished_reason="abort"}'] > before.get(
            'vllm:request_success_total{finished_reason="abort"}', 0
        ):
            break
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.05)
    assert now["vllm:num_requests_running"] == 0 and now["vllm:kv_cache_usage_perc"] == 0
    assert now["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 100
    assert (
        server.state.engine.engine.scheduler.blocks.num_free_blocks
        == server.state.engine.engine.config.num_blocks
    )


def test_stream_with_json_lines_is_sse(server):
    body = {"prompt": "the", "max_tokens": 3, "stream": True}
    text = httpx.post(server.v1 + "/completions", json=body).text
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e.removeprefix("data: "))["object"] == "text_completion" for e in events[:-1])
