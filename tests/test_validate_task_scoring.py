"""Scoring the task suite through the engine's model, and the attention flip measurement."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.validate.tasks.generators import build_samples
from mlaq.validate.tasks.haystack import Haystack
from mlaq.validate.tasks.scoring import batches, score_variants
from mlaq.validate.tasks.spec import TaskConfig

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import CHARS, eval_text, local_config, tiny_checkpoint

V = len(CHARS)


def encode(text: str) -> list[int]:
    return [CHARS.index(c) if c in CHARS else CHARS.index("?") for c in text]


def samples(lengths=(230, 250), n=3, tasks=("needle", "copy", "vartrack")):
    cfg = TaskConfig(tasks=tasks, lengths=lengths, samples=n, copy_tokens=64)
    return build_samples(cfg, Haystack("t", tuple(encode(eval_text()))), encode)


class _Fake:
    """A stand-in model on the decode path: ``kind`` 'next' sees the teacher-forced next token (an
    oracle), 'echo' predicts the current token (causal, no retrieval), 'uniform' predicts nothing."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def prefill_cache(self, ids, cache):
        return None

    def decode(self, tail, cache):
        b, t = tail.shape
        logits = torch.zeros(b, t, V)
        if self.kind == "next":
            logits[:, :-1].scatter_(2, tail[:, 1:, None], 50.0)
        elif self.kind == "echo":
            logits.scatter_(2, tail[:, :, None], 50.0)
        return type("Out", (), {"logits": logits})()


def test_scores_read_the_positions_that_predict_the_answer() -> None:
    s = samples()
    fakes = {k: _Fake(k) for k in ("next", "echo", "uniform")}
    scores = score_variants(s, list(fakes), fakes.__getitem__, lambda k: k, batch_tokens=400)
    assert all(x.correct and x.logprob > -1e-6 for x in scores["next"])
    assert not any(x.correct for x in scores["echo"])  # an off-by-one would make this one perfect
    # nothing known: exactly chance, log(1/V) per answer token
    assert all(not x.correct and x.logprob == pytest.approx(-math.log(V)) for x in scores["uniform"])


class _Counting(_Fake):
    """An oracle that counts its prefills and checks that no earlier batch's cache is still alive."""

    def __init__(self, alive: list) -> None:
        super().__init__("next")
        self.alive = alive
        self.prefills = 0

    def prefill_cache(self, ids, cache):
        import gc
        import weakref

        gc.collect()
        assert all(r() is None for r in self.alive), "an earlier batch's cache is still held"
        self.alive.append(weakref.ref(cache))
        self.prefills += 1


def test_one_prefill_per_batch_shared_by_the_schemes_and_memory_bounded() -> None:
    s = samples()
    groups = len(batches(s, 400))
    model = _Counting([])
    scores = score_variants(s, ["a", "b", "c"], lambda v: model, lambda v: 0, batch_tokens=400)
    assert model.prefills == groups  # one prefill per batch, whatever the number of schemes
    assert all(x.correct for v in scores for x in scores[v]) and len(scores["c"]) == len(s)
    model = _Counting([])
    score_variants(s, ["a", "b", "c"], lambda v: model, lambda v: v, batch_tokens=400)
    assert model.prefills == 3 * groups  # distinct keys (consistent precision): one prefill each


def test_batches_group_equal_lengths() -> None:
    s = samples(lengths=(230, 250), n=3)
    groups = batches(s, batch_tokens=500)
    assert sorted(i for g in groups for i in g) == list(range(len(s)))
    for g in groups:
        assert len({s[i].length for i in g}) == 1 and len(g) * s[g[0]].length <= 500


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from mlaq.model import load_model
    from mlaq.settings import Settings

    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny_tasks"))
    m = load_model(path, dtype=torch.bfloat16, settings=Settings())
    for layer in m.model.layers:
        layer.self_attn.prepare("bf16")
    return m


def _prepare(model, scheme: str):
    for layer in model.model.layers:
        layer.self_attn.prepare(scheme)
    return model


def test_engine_scoring_shares_the_prefill_and_applies_the_scheme(model) -> None:
    s = samples()
    shared = score_variants(s, ["bf16", "mxfp4"], lambda v: _prepare(model, v), lambda v: 0)
    alone = score_variants(s, ["mxfp4", "bf16"], lambda v: _prepare(model, v), lambda v: v)
    assert shared == alone  # decode_only: the prefill does not depend on the scheme; caches truncate back
    lp = {v: [x.logprob for x in shared[v]] for v in shared}
    assert lp["bf16"] != lp["mxfp4"]  # the decode path runs the scheme's BMMs
    # a random model cannot retrieve: nothing right, answer log-prob near chance
    assert not any(x.correct for x in shared["bf16"])
    assert abs(sum(lp["bf16"]) / len(s) + math.log(V)) < 1.5


@pytest.mark.parametrize("native", [True, False])
def test_float32_held_cache_changes_no_bit(model, monkeypatch, native: bool) -> None:
    """Where the decode multiplies in float32 the shared prefill's cache is converted once (exact):
    every score equals the one from the cache held in bf16 and converted at each call."""
    from mlaq.model.layers import cache as cache_module
    from mlaq.model.layers import linear, mla_latent

    s = samples()
    held: list[bool] = []
    real = cache_module.ModelCache.hold_latents
    monkeypatch.setattr(cache_module.ModelCache, "hold_latents", lambda c, d: held.append(True) or real(c, d))
    monkeypatch.setattr(linear, "native_low_precision_gemm", lambda: native)
    monkeypatch.setattr(mla_latent, "native_low_precision_gemm", lambda: native)
    got = score_variants(s, ["bf16", "mxfp4"], lambda v: _prepare(model, v), lambda v: 0)
    assert bool(held) is (not native)
    monkeypatch.setattr(cache_module.ModelCache, "hold_latents", lambda c, d: None)
    want = score_variants(s, ["bf16", "mxfp4"], lambda v: _prepare(model, v), lambda v: 0)
    assert got == want


def test_exact_match_is_greedy_decoding(model) -> None:
    """Exact match under teacher forcing == greedy decoding reproduces the answer: a sample whose answer
    IS the model's step-by-step greedy continuation scores correct; one token changed, it does not."""
    from dataclasses import replace

    from mlaq.model import ModelCache

    _prepare(model, "bf16")
    base = samples(lengths=(230,), n=2, tasks=("needle",))
    made = []
    for sample in base:
        prompt = sample.prompt[:-6]
        cache = ModelCache()
        model.prefill(torch.tensor([prompt[:-1]]), cache)
        token, greedy = prompt[-1], []
        for _ in range(6):
            token = int(model.decode(torch.tensor([[token]]), cache).logits[0, -1].argmax())
            greedy.append(token)
        made.append(replace(sample, prompt=prompt, answer=tuple(greedy)))
        wrong = (*greedy[:-1], (greedy[-1] + 1) % V)
        made.append(replace(sample, prompt=prompt, answer=wrong))
    scores = score_variants(made, ["bf16"], lambda v: model, lambda v: 0)["bf16"]
    assert [x.correct for x in scores] == [True, False] * len(base)
    assert [x.token_accuracy for x in scores[1::2]] == [5 / 6] * len(base)


def test_flip_rate_zero_against_itself_and_positive_under_mxfp4(model) -> None:
    from mlaq.validate.capture import capture_reference
    from mlaq.validate.flips import attention_flips, flip_reference, sample_rows

    _prepare(model, "bf16")
    ids = torch.tensor([encode(eval_text())[:96]])
    window = capture_reference(model, ids)
    refs = [
        flip_reference(model, inp, model.model.layers[inp.layer].self_attn.absorbed, 40)
        for inp in window.layers
    ]
    for inp, ref in zip(window.layers, refs, strict=True):
        f = attention_flips(model, ref)
        assert not f.flipped.any() and float(f.tv.abs().max()) == 0.0
        pos = inp.positions[0, sample_rows(inp.hidden.shape[1], 40)]
        assert f.keys.tolist() == (pos - inp.positions[0, 0] + 1).tolist()  # causal: every earlier key
    _prepare(model, "mxfp4")
    flips = [attention_flips(model, ref) for ref in refs]
    assert any(f.flipped.any() for f in flips) and all(float(f.tv.max()) > 0 for f in flips)
    _prepare(model, "bf16")


def test_model_pool_reinstalls_a_schemes_weights_without_requantizing(tmp_path) -> None:
    """Switching back to a scheme installs the weights prepared the first time (the task suite switches
    schemes once per batch): same objects, same outputs as a fresh prepare."""
    from mlaq.model import ModelCache
    from mlaq.validate.config import Variant, VariantKind
    from mlaq.validate.variants import ModelPool

    path = tiny_checkpoint(tmp_path)
    pool = ModelPool(local_config(path))
    mx = Variant("mxfp4", VariantKind.SCHEME, torch.bfloat16, "mxfp4")
    bf = Variant("bf16", VariantKind.SCHEME, torch.bfloat16, "bf16")
    model = pool.model(mx)
    first = [layer.self_attn.absorbed.w_uk for layer in model.model.layers]
    ids = torch.tensor([encode(eval_text())[:40]])
    want = model.decode(ids, ModelCache()).logits
    assert pool.model(bf).model.layers[0].self_attn.absorbed.scheme_uk.name == "bf16"
    again = pool.model(mx)
    now = [layer.self_attn.absorbed.w_uk for layer in again.model.layers]
    assert all(a is b for a, b in zip(now, first, strict=True))  # the same objects: not re-quantized
    assert all(layer.self_attn.absorbed.scheme_uk.name == "mxfp4" for layer in again.model.layers)
    assert torch.equal(again.decode(ids, ModelCache()).logits, want)
