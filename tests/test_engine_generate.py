"""The engine end to end on a toy latent-cache LM: paged cache vs full recompute, batching,
speculative greedy ≡ plain greedy, seeds, stops, streaming, metrics."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from torch import Tensor

from mlaq.engine.engine import EngineConfig, LLMEngine
from mlaq.engine.llm import LLM
from mlaq.engine.model_api import CacheGeometry, LMOutput
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.spec_metrics import SpecDecodingStats

V, H, L, R = 40, 24, 10, 6


class ToyLM:
    """A causal LM over a per-layer latent cache, float64 (so cached and recomputed agree to the bit
    in argmax). The next token is mostly a fixed function of the current one (``table``) plus an
    attention term over the whole history; its MTP layer knows ``table`` but not the history, so
    drafts are often, not always, right."""

    def __init__(self, layers: int = 2, seed: int = 0, context: float = 1.5) -> None:
        g = torch.Generator().manual_seed(seed)

        def rand(*shape: int, scale: float = 1.0) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

        self.embed = rand(V, H)
        self.table = rand(V, V, scale=3.0)
        self.context = context
        self.layers = [
            (rand(H, L + R, scale=H**-0.5), rand(H, L + R), rand(L + R, H)) for _ in range(layers + 1)
        ]
        self.mtp_in = rand(2 * H, H, scale=(2 * H) ** -0.5)
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    @property
    def geometry(self) -> CacheGeometry:
        return CacheGeometry(len(self.layers) - 1, 1, L, R, torch.float64)

    @property
    def vocab_size(self) -> int:
        return V

    def _attend(self, layer: int, x: Tensor, positions: Tensor, past: Tensor) -> tuple[Tensor, Tensor]:
        w_a, w_q, w_o = self.layers[layer]
        latent = torch.tanh(x @ w_a)  # (B, T, E)
        b, t, e = latent.shape
        k = max(past.shape[1], int(positions.max()) + 1)
        keys = torch.zeros(b, k, e, dtype=x.dtype)
        keys[:, : past.shape[1]] = past
        keys.scatter_(1, positions[:, :, None].expand(b, t, e), latent)  # write, then read
        scores = (x @ w_q) @ keys.transpose(1, 2) / math.sqrt(e)  # (B, T, K)
        visible = torch.arange(k)[None, None, :] <= positions[:, :, None]
        attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        return x + (attn @ keys) @ w_o, latent

    def _logits(self, ids: Tensor, x: Tensor, index: Tensor | None = None) -> Tensor:
        if index is not None:  # only each row's position index[b]: (B, 1, ...)
            rows = torch.arange(ids.shape[0])
            ids, x = ids[rows, index][:, None], x[rows, index][:, None]
        return (self.table[ids] + self.context * torch.tanh(x @ self.embed.T)).float()

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Sequence[Tensor],
        *,
        prefill: bool,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        self.calls.append(("prefill" if prefill else "decode", tuple(input_ids.shape)))
        x = self.embed[input_ids]
        entries = []
        for i, p in enumerate(past):
            x, e = self._attend(i, x, positions, p)
            entries.append(e)
        return LMOutput(self._logits(input_ids, x, logits_index), x, tuple(entries))

    def mtp(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past: Tensor,
        *,
        step: int,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        self.calls.append(("mtp", tuple(input_ids.shape)))
        x = torch.tanh(torch.cat([self.embed[input_ids], hidden], dim=-1) @ self.mtp_in)
        x, e = self._attend(len(self.layers) - 1, x, positions, past)
        return LMOutput(self._logits(input_ids, x, logits_index), x, (e,))

    def greedy_reference(self, prompt: list[int], n: int) -> list[int]:
        """Greedy decoding by full recompute of the whole sequence each step (no cache at all)."""
        tokens = list(prompt)
        for _ in range(n):
            ids = torch.tensor([tokens])
            empty = torch.zeros(1, 0, L + R, dtype=torch.float64)
            out = self.forward(
                ids, torch.arange(len(tokens))[None], [empty] * (len(self.layers) - 1), prefill=True
            )
            tokens.append(int(out.logits[0, -1].argmax()))
        return tokens[len(prompt) :]


def spec_reference(model: ToyLM, prompt: list[int], k: int, n: int) -> tuple[list[int], SpecDecodingStats]:
    """Greedy MTP speculative decoding with no cache: every pass recomputes the whole sequence."""
    layers = len(model.layers) - 1
    empty = torch.zeros(1, 0, L + R, dtype=torch.float64)

    def target(tokens: list[int]) -> LMOutput:
        return model.forward(
            torch.tensor([tokens]), torch.arange(len(tokens))[None], [empty] * layers, prefill=True
        )

    tokens = list(prompt)
    tokens.append(int(target(tokens).logits[0, -1].argmax()))  # the prefill's token
    stats = SpecDecodingStats.new(k)
    while len(tokens) - len(prompt) < n:
        size = len(tokens)
        h = target(tokens).hidden[0]  # (N, H)
        mtp_tokens, mtp_hidden, drafts = tokens[1:], list(h[: size - 1]), []  # MTP at p reads h_p, x_{p+1}
        kk = min(k, n - (size - len(prompt)) - 1)  # vLLM: a step computes at most prompt + n - 1 tokens
        for _ in range(kk):
            ids = torch.tensor([mtp_tokens])
            out = model.mtp(
                ids, torch.stack(mtp_hidden)[None], torch.arange(ids.shape[1])[None], empty, step=0
            )
            drafts.append(int(out.logits[0, -1].argmax()))
            mtp_tokens.append(drafts[-1])
            mtp_hidden.append(out.hidden[0, -1])  # the chain runs on the MTP's own hidden state
        best = target(tokens + drafts).logits[0, size - 1 :].argmax(-1).tolist()  # (k+1,)
        accepted = next((i for i in range(kk) if drafts[i] != best[i]), kk)
        stats = stats.observe(kk, accepted) if kk else stats
        tokens += best[: accepted + 1]
    return tokens[len(prompt) :][:n], stats


PROMPTS = [[3, 14, 15, 9, 2, 6], [5], [35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 2, 6, 4], [1, 2]]


def run(prompts, params, spec_k=0, **config) -> tuple[list, LLMEngine]:
    model = ToyLM()
    spec = {"method": "mtp", "num_speculative_tokens": spec_k} if spec_k else None
    llm = LLM(model, speculative_config=spec, **{"max_model_len": 64, "block_size": 4, **config})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return outs, llm.engine


def test_paged_decoding_matches_full_recompute():
    outs, _ = run(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    model = ToyLM()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert list(out.outputs[0].token_ids) == model.greedy_reference(prompt, 12)
        assert out.finished and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_speculative_greedy_equals_plain_greedy(k):
    """The main correctness test: same tokens, token for token, for a batch of ragged prompts."""
    params = SamplingParams(temperature=0, max_tokens=20)
    plain, _ = run(PROMPTS, params)
    spec, engine = run(PROMPTS, params, spec_k=k)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = engine.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both accepts and rejects happened
    per_request = sum((o.spec_decoding_stats for o in spec), start=type(stats)())
    assert per_request == stats  # the engine total is the sum over requests


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_and_acceptance_match_a_cache_free_reference(k):
    """Pins the MTP wiring (catch-up positions, chained hidden states): every verification step's
    acceptance count equals a from-scratch simulation's, so the metrics are the model's, not the cache's."""
    outs, _ = run(PROMPTS, SamplingParams(temperature=0, max_tokens=16), spec_k=k)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, stats = spec_reference(ToyLM(), prompt, k, 16)
        assert list(out.outputs[0].token_ids) == tokens
        assert out.spec_decoding_stats == stats


def test_speculation_saves_target_passes():
    params = SamplingParams(temperature=0, max_tokens=20)
    _, plain = run(PROMPTS[:1], params)
    _, spec = run(PROMPTS[:1], params, spec_k=3)
    passes = [sum(c[0] == "decode" for c in e.model.calls) for e in (plain, spec)]
    assert passes[1] < passes[0] and spec.spec_decoding_stats.mean_acceptance_length > 1.5, passes


def test_batching_and_preemption_do_not_change_greedy_tokens():
    params = SamplingParams(temperature=0, max_tokens=15)
    alone = [run([p], params)[0][0].outputs[0].token_ids for p in PROMPTS]
    tight, engine = run(PROMPTS, params, spec_k=2, max_num_seqs=3, num_kv_blocks=9)  # forces preemption
    assert sum(c[0] == "prefill" for c in engine.model.calls) > 3  # some prefills were recomputes
    assert [o.outputs[0].token_ids for o in tight] == alone


def test_seeded_sampling_is_reproducible_and_batch_independent():
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)
    a, _ = run(PROMPTS[:1], p)
    b, _ = run([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [SamplingParams(temperature=1.0, max_tokens=5), p, p])
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    c, _ = run(PROMPTS[:1], p, spec_k=2)  # speculative sampling: same seed, same result, again
    d, _ = run(PROMPTS[:1], p, spec_k=2)
    assert c[0].outputs[0].token_ids == d[0].outputs[0].token_ids


def test_stop_token_ids_max_model_len_and_logprobs():
    ref = ToyLM().greedy_reference(PROMPTS[0], 10)
    stop = ref[4]
    first = ref.index(stop)
    for k in (0, 3):
        out = run(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]), spec_k=k)[
            0
        ][0]
        c = out.outputs[0]
        assert list(c.token_ids) == ref[: first + 1] and c.finish_reason == "stop" and c.stop_reason == stop
    out = run(
        PROMPTS[:1], SamplingParams(temperature=0, max_tokens=50, logprobs=2), spec_k=2, max_model_len=10
    )[0][0]
    c = out.outputs[0]
    assert len(PROMPTS[0]) + len(c.token_ids) == 10 and c.finish_reason == "length"
    assert len(c.logprobs) == len(c.token_ids) and all(
        t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True)
    )
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    )
    assert all(len(lp) <= 3 for lp in c.logprobs)


def test_prompt_too_long_and_bad_tokens_are_clear_errors():
    llm = LLM(ToyLM(), max_model_len=8)
    with pytest.raises(ValueError, match="9 tokens does not fit max_model_len=8"):
        llm.generate({"prompt_token_ids": list(range(9))})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [V + 1]})
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="unsupported speculative method 'eagle'"):
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_stream_folds_to_generate():
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(ToyLM(), max_model_len=64, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    deltas = list(llm.generate_stream([{"prompt_token_ids": p} for p in PROMPTS[:2]], params))
    assert sum(d.finished for d in deltas) == 2 and len(deltas) > 4
    by_id: dict[str, list[int]] = {}
    for d in deltas:
        by_id.setdefault(d.request_id, []).extend(d.outputs[0].token_ids)
    full, _ = run(PROMPTS[:2], params, spec_k=2)
    assert [by_id[o.request_id] for o in full] == [list(o.outputs[0].token_ids) for o in full]


def test_dtype_takes_vllms_names() -> None:
    """``LLM(dtype="bfloat16")`` as in vLLM; a name it does not know is a clear error, not a torch TypeError."""
    import torch

    from mlaq.engine.config import resolve_dtype

    assert resolve_dtype("bfloat16") is torch.bfloat16 and resolve_dtype("half") is torch.float16
    assert (
        resolve_dtype("FLOAT") is torch.float32
        and resolve_dtype("auto") is None
        and resolve_dtype(None) is None
    )
    assert resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(
        ValueError, match=r"dtype 'bf16' is not one of auto, half, float16, bfloat16, float, float32"
    ):
        resolve_dtype("bf16")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        LLM("does-not-matter", dtype="int8")  # refused before anything is loaded


def test_max_num_batched_tokens_batches_prompts_without_changing_tokens():
    """vLLM's knob: how many prompt tokens one prefill step takes (default max_model_len)."""
    params = SamplingParams(temperature=0, max_tokens=3)
    apart, small = run(PROMPTS, params, max_model_len=16)  # 6 + 1, then 13 + 2: two prefills
    together, large = run(PROMPTS, params, max_model_len=16, max_num_batched_tokens=64)
    assert [c[0] for c in small.model.calls].count("prefill") == 2
    assert [c[0] for c in large.model.calls].count("prefill") == 1
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in apart]
    with pytest.raises(ValueError, match="must be at least max_model_len"):
        run(PROMPTS, params, max_model_len=16, max_num_batched_tokens=8)


def test_fold_adds_up_deltas_field_by_field():
    """``fold``: texts, token ids and logprobs joined in order, the last delta's finish fields, the first prompt
    logprobs; a delta without logprobs makes the whole output's None; another request's delta is refused."""
    from mlaq.engine.outputs import CompletionOutput, RequestOutput, fold

    def delta(text, ids, lps, *, finish=None, prompt_lp=None, rid="r"):
        out = CompletionOutput(0, text, ids, -1.0, lps, finish_reason=finish)
        return RequestOutput(rid, "p", (5,), (out,), finish is not None, prompt_logprobs=prompt_lp)

    parts = [
        delta("a", (1,), ({1: -0.5},), prompt_lp=(None,)),
        delta("bc", (2, 3), ({2: -0.1}, {3: -0.2})),
        delta("", (), ()),
        delta("d", (4,), ({4: -0.3},), finish="length"),
    ]
    out = fold(parts)
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("abcd", (1, 2, 3, 4), "length") and out.finished
    assert c.logprobs == ({1: -0.5}, {2: -0.1}, {3: -0.2}, {4: -0.3}) and out.prompt_logprobs == (None,)
    assert fold(parts[:1]) == parts[0]
    assert fold([*parts[:2], delta("x", (9,), None)]).outputs[0].logprobs is None
    with pytest.raises(ValueError, match="cannot fold outputs of 'r' and 's'"):
        fold([parts[0], delta("x", (9,), None, rid="s")])
    with pytest.raises(ValueError, match="no outputs to fold"):
        fold([])
