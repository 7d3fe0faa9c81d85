"""scripts/train_ctx.py (the bundled mlaq-tiny-4k's trainer) and its task data (scripts/ctx_data.py).

Smoke runs use a tiny model, 40 stdlib files and a two-file prose corpus made here, eager, on CPU.
"""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import SRC

pytest.importorskip("tokenizers")
sys.path.insert(0, str(SRC.parent / "scripts"))

from ctx_data import (
    DENSE,
    FAR,
    LONG,
    NEEDLE,
    Mix,
    copy_window,
    kv_window,
    make_window,
    split_query,
    vartrack_window,
)
from tiny_data import train_tokenizer


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("prose")
    (root / "train").mkdir()
    for i in range(2):
        (root / "train" / f"doc{i}.rst").write_text(
            f"Section {i}\n=========\n\n" + "The driver binds the device. " * 200
        )
    (root / "held" / "tutorial").mkdir(parents=True)
    (root / "held" / "tutorial" / "intro.rst.txt").write_text("An informal introduction to Python.\n" * 50)
    return root


def run(tmp_path, dirs, phases: str, *extra: str) -> None:
    from train_ctx import main

    main(["--smoke", "--no-compile", "--threads", "1", "--phases", phases, "--decay-tokens", "0",
          "--warmup", "2", "--run-dir", str(tmp_path / "run"), "--out", str(tmp_path / "out"),
          "--commit-state", str(tmp_path / "commit" / "state.safetensors"),
          "--prose-dir", str(dirs / "train"), "--heldout-prose-dir", str(dirs / "held"), *extra])  # fmt: skip


def test_smoke_run_exports_a_loadable_checkpoint(tmp_path, dirs):
    run(tmp_path, dirs, "64x2:256,128x1:128")
    out = tmp_path / "out"
    meta = json.loads((out / "training.json").read_text())
    assert meta["tokens"] == 384 and meta["step"] == 3
    assert (out / "heldout-prose.txt").read_text().startswith("An informal introduction")
    assert "csv" in (out / "heldout.txt").read_text()[:2000]  # the held-out stdlib modules' source
    assert (tmp_path / "commit" / "state.safetensors").is_file()  # the phase-boundary copy for git
    from mlaq.model import load_model

    model = load_model(out, dtype=torch.float32)
    assert model.num_mtp_layers == 1


def test_yarn_run_extends_a_model_and_refuses_a_context_mismatch(tmp_path, dirs):
    """--yarn-factor from a plain model directory: the export is that model's tokenizer, 4x its context
    with DeepSeek's YaRN config, and mlaq loads it; a model of another context is refused in one line."""
    run(tmp_path / "base", dirs, "64x2:128")  # a plain model with a 64-token context
    base = tmp_path / "base" / "out"
    run(tmp_path / "long", dirs, "128x1:128,256x1:256", "--init-from", str(base), "--yarn-factor", "4")
    out = tmp_path / "long" / "out"
    c = json.loads((out / "config.json").read_text())
    assert c["max_position_embeddings"] == 256
    assert c["rope_parameters"]["rope_type"] == "yarn" and c["rope_parameters"]["factor"] == 4.0
    assert c["rope_parameters"]["original_max_position_embeddings"] == 64
    assert (out / "tokenizer.json").read_text() == (base / "tokenizer.json").read_text()
    from mlaq.model import load_model

    assert load_model(out, dtype=torch.float32).num_mtp_layers == 1
    # a YaRN model continued with another factor
    with pytest.raises(SystemExit, match=r"YaRN factor 4\.0, but this run has 64 with 2\.0"):
        run(tmp_path / "again", dirs, "128x1:128", "--init-from", str(out), "--yarn-factor", "2")
    with pytest.raises(SystemExit, match="context 64 with YaRN factor none, but this run has 128"):
        run(tmp_path / "far", dirs, "256x1:256", "--init-from", str(base), "--yarn-factor", "2")


def test_interrupted_run_resumes_bit_exactly(tmp_path, dirs):
    """Stopping at a phase boundary and resuming gives the weights of one uninterrupted run."""
    run(tmp_path / "a", dirs, "64x2:256,128x1:128")
    run(tmp_path / "b", dirs, "64x2:256")  # stops after phase 0
    run(tmp_path / "b", dirs, "64x2:256,128x1:128")  # resumes from the saved state
    a = load_file(tmp_path / "a" / "run" / "state.safetensors")
    b = load_file(tmp_path / "b" / "run" / "state.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["x = 1\nThe value of a is b.\n" * 50, "def f(y):\n    return y\n" * 50], 400)


def test_task_windows_have_exact_length_and_are_deterministic(tok):
    streams = [np.arange(5000) % 300, (np.arange(5000) * 7) % 300]
    for n in (64, 256, 1024):
        for seed in range(20):
            w1, m1 = make_window(streams, n, tok, np.random.default_rng(seed), Mix())
            w2, m2 = make_window(streams, n, tok, np.random.default_rng(seed), Mix())
            assert len(w1) == len(m1) == n + 1 and np.array_equal(w1, w2) and np.array_equal(m1, m2)


def test_kv_window_queries_facts_stated_earlier(tok):
    hay = list(range(1000, 3000))  # ids above the vocabulary spell nothing: only the task's text decodes
    for seed in range(10):
        w, mask = kv_window(hay, 1024, tok, np.random.default_rng(seed))
        assert len(w) == len(mask) == 1025
        text = tok.decode([i for i in w if i < 400])
        last = text.strip().splitlines()[-1]
        keys = re.findall(r"[a-z]+(?:_[a-z0-9]+)+", last)
        assert keys and all(text.count(k) >= 2 for k in keys), (last, text[:300])


def test_dense_kv_windows_query_every_fact(tok):
    """--mix dense: each key stated in the window is queried (up to 32); the default mix queries only some
    of them, so over the same draws dense asks more."""
    hay = list(range(1000, 3000))
    asked = {"dense": 0, "default": 0}
    for seed in range(12):
        for name, mix in (("dense", DENSE), ("default", Mix())):
            w, _ = kv_window(hay, 1024, tok, np.random.default_rng(seed), mix)
            text = tok.decode([i for i in w if i < 400])
            keys = re.findall(r"[a-z]+(?:_[a-z0-9]+)+", text)
            counts = {k: keys.count(k) for k in set(keys)}
            asked[name] += sum(c >= 2 for c in counts.values())
            if name == "dense" and len(counts) <= 32:
                assert all(c >= 2 for c in counts.values()), counts
    assert asked["dense"] > asked["default"], asked


def test_long_mix_has_needles_and_many_keys(tok):
    """--mix long: a quarter of kv windows are needles (1-3 facts; ~1 in 40 by chance without that share),
    others hold more than the dense mix's 64."""
    hay = list(range(1000, 30000))
    counts = []
    for seed in range(40):
        w, _ = kv_window(hay, 16384, tok, np.random.default_rng(seed), LONG)
        keys = re.findall(r"[a-z]+(?:_[a-z0-9]+)+", tok.decode([i for i in w if i < 400]))
        counts.append(len(set(keys)))
    assert sum(c <= 3 for c in counts) >= 5 and max(counts) > 64, counts


class _Recorder:
    """A numpy Generator that records the name of every method called on it."""

    def __init__(self, seed: int):
        self.rng, self.calls = np.random.default_rng(seed), []

    def __getattr__(self, name: str):
        self.calls.append(name)
        return getattr(self.rng, name)


def test_needle_mix_opens_a_share_of_windows_with_a_fact_and_leaves_other_mixes_alone(tok):
    """--mix needle: ~30 % of kv windows start with their first fact (token 0 is the fact's newline, then
    the key). A mix without `lead` makes no extra random draw, so it draws exactly the windows it drew
    before: with lead = 1 the calls are those of lead = 0 plus one `random()`, and the window opens with
    a fact."""
    hay = list(range(1000, 30000))  # ids above the vocabulary: a window opens with text only for a fact
    opened = 0
    for seed in range(60):
        w, _ = kv_window(hay, 4096, tok, np.random.default_rng(seed), NEEDLE)
        opened += w[0] < 400
    assert 10 <= opened <= 30, opened
    assert NEEDLE.few > LONG.few and NEEDLE.kv > LONG.kv
    always, laid_out = Mix(**{**LONG.__dict__, "lead": 1.0}), 0
    for seed in range(20):
        without, with_lead = _Recorder(seed), _Recorder(seed)
        kv_window(hay, 4096, tok, without, LONG)
        w, mask = kv_window(hay, 4096, tok, with_lead, always)
        if not any(mask):  # too many facts for the length: plain text, drawn before any layout
            assert with_lead.calls == without.calls, seed
            continue
        laid_out += 1
        assert with_lead.calls == [*without.calls, "random"], seed
        assert w[0] < 400
    assert laid_out >= 10, laid_out


def test_far_mix_keeps_half_the_windows_facts_in_the_first_quarter(tok):
    """--mix far: in ~half of kv windows every fact precedes the first quarter of the haystack (fewer than
    n / 4 haystack tokens before the last fact's last token), so its query is >= 3/4 of the window away;
    with far = 1 all of them, and a mix without `far` draws exactly as before (one `random()` fewer)."""
    hay = list(range(1000, 30000))  # haystack ids above the vocabulary: facts and queries are below it

    def hay_before_last_fact(w: list[int], mask: list[int]) -> int:
        queries = next(i for i, m in enumerate(mask) if m)  # the query block opens before the first answer
        last = max(i for i in range(queries) if w[i] < 1000 and any(x >= 1000 for x in w[i:queries]))
        return sum(x >= 1000 for x in w[:last])

    always = Mix(**{**FAR.__dict__, "far": 1.0})
    near, laid_out = 0, 0
    for seed in range(40):
        w, mask = kv_window(hay, 4096, tok, np.random.default_rng(seed), always)
        if any(mask):
            laid_out += 1
            assert hay_before_last_fact(w, mask) <= 4096 // 4, seed
        w, mask = kv_window(hay, 4096, tok, np.random.default_rng(seed), FAR)
        near += any(mask) and hay_before_last_fact(w, mask) > 4096 // 4
    assert laid_out >= 30 and 5 <= near <= 30, (laid_out, near)
    without, with_far = _Recorder(3), _Recorder(3)
    kv_window(hay, 4096, tok, without, Mix(**{**FAR.__dict__, "far": 0.0}))
    kv_window(hay, 4096, tok, with_far, always)
    assert with_far.calls == [*without.calls[:-1], "random", without.calls[-1]]


def test_copy_window_repeats_a_segment(tok):
    hay = list(range(1000, 1600))  # no 24-token run repeats in the haystack itself
    for seed in range(10):
        w, mask = copy_window(hay, 512, tok, np.random.default_rng(seed))
        assert len(w) == len(mask) == 513 and sum(mask) >= 20  # the repeat is weighted
        runs = {tuple(w[i : i + 24]) for i in range(len(w) - 24)}
        assert len(runs) < len(w) - 24, f"seed {seed}: no repeated 24-token segment"


def enc_of(tok):
    return lambda s: tok.encode(s, add_special_tokens=False).ids


def test_split_query_marks_the_value_with_its_space_as_the_task_suite_splits_it(tok):
    """`assert k ==` + ` 48213`: the answer mask covers exactly the value's ids (with its leading space)."""
    enc = enc_of(tok)
    split = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        ids, mask = split_query("assert {k} == {v}", rng, enc, k="bo_ka", v="48213")
        assert len(ids) == len(mask)
        assert tok.decode(ids) == tok.decode(enc("assert bo_ka == 48213\n"))
        answer = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert answer.strip() == "48213", answer
        head = enc("assert bo_ka ==")
        if ids[: len(head)] == head:  # split as the suite splits it: the answer is exactly " 48213"'s ids
            split += 1
            assert [i for i, m in zip(ids, mask, strict=True) if m] == enc(" 48213")
    assert split >= 5, split


def test_answers_of_task_windows_are_stated_earlier_in_the_window(tok):
    """Every masked (answer) span of a kv / vartrack window is a value whose text occurs before the queries."""
    hay = list(range(1000, 3000))
    for make in (kv_window, vartrack_window):
        for seed in range(10):
            w, mask = make(hay, 1024, tok, np.random.default_rng(seed))
            if not any(mask):
                continue  # fell back to plain text
            first = mask.index(1)
            before = tok.decode([i for i in w[:first] if i < 400])
            runs, cur = [], []
            for i, m in zip(w, mask, strict=True):
                if m:
                    cur.append(i)
                elif cur:
                    runs, cur = [*runs, cur], []
            answers = [tok.decode(r).strip() for r in [*runs, cur] if r]
            assert answers and all(a in before for a in answers), (answers, before[-200:])


def test_weighted_loss_is_the_weighted_mean_of_token_losses():
    from tiny_lean import LeanTiny
    from tiny_model import TinyGeometry, build_config

    geo = TinyGeometry(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                       intermediate_size=32, moe_intermediate_size=16, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = LeanTiny(build_config(geo, bos_token_id=0, eos_token_id=1).to_dict()).eval()
    x = torch.randint(0, 64, (2, 17))
    logits, _, plain, _ = model(x)
    _, _, ones, _ = model(x, torch.ones(2, 16))
    w = torch.rand(2, 16)
    _, _, weighted, _ = model(x, w)
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="none")
    assert torch.allclose(ones, plain)
    assert torch.allclose(weighted, (ce * w.flatten()).sum() / w.sum())
    assert not torch.allclose(weighted, plain)


def test_init_from_starts_a_new_run_and_carries_the_prior_tokens(tmp_path, dirs):
    run(tmp_path / "a", dirs, "64x2:256")
    state = tmp_path / "a" / "run" / "state.safetensors"
    other = tmp_path / "other-prose"  # a new tokenizer would differ: other prose
    other.mkdir()
    (other / "doc.rst").write_text("Quantum flux capacitors oscillate wildly. " * 300)
    run(tmp_path / "b", dirs, "64x2:128", "--init-from", str(state), "--prose-dir", str(other))
    meta = json.loads((tmp_path / "b" / "out" / "training.json").read_text())
    assert meta["tokens"] == 128 and meta["init_from"]["tokens"] == 256
    # the weights' tokenizer (the state's run's), not a new one from this run's seed and empty --out
    tokenizers = [(tmp_path / r / "out" / "tokenizer.json").read_text() for r in ("a", "b")]
    assert tokenizers[0] == tokenizers[1]


def test_init_from_a_model_directory_takes_its_weights(tmp_path, dirs):
    """A new run from an exported directory (weights only, no optimizer state) starts from those weights."""
    run(tmp_path / "a", dirs, "64x2:256")
    run(tmp_path / "b", dirs, "64x2:128", "--init-from", str(tmp_path / "a" / "out"), "--lr", "0")
    a = load_file(tmp_path / "a" / "out" / "model.safetensors")
    b = load_file(tmp_path / "b" / "out" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if "e_score" not in k)
    meta = json.loads((tmp_path / "b" / "out" / "training.json").read_text())
    assert meta["init_from"]["tokens"] == 256


def small_geometry(context: int):
    from tiny_model import TinyGeometry

    return TinyGeometry(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, q_lora_rank=16,
                        kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                        intermediate_size=32, moe_intermediate_size=16, max_position_embeddings=context)  # fmt: skip


def test_train_past_context_runs_longer_windows_and_keeps_the_context(tmp_path, dirs):
    """Phases past the context are refused in one line unless --train-past-context; with it the run trains
    on the longer windows (RoPE continued past the context) and the export keeps the shorter context."""
    import argparse

    from ctx_plan import context

    geo = small_geometry(64)
    a = argparse.Namespace(init_from=None, yarn_factor=0.0, train_past_context=False)
    with pytest.raises(SystemExit, match=r"reaches 128 tokens, past the context 64; .*--train-past-context"):
        context(a, geo, [(64, 2, 128), (128, 1, 128)])
    a.train_past_context = True
    assert context(a, geo, [(64, 2, 128), (128, 1, 128)]) == (geo, None)
    run(tmp_path / "b", dirs, "64x2:128,128x1:256", "--train-past-context")
    out = tmp_path / "b" / "out"
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 64
    meta = json.loads((out / "training.json").read_text())
    assert meta["tokens"] == 384 and meta["step"] == 3


def test_rope_table_past_the_context_continues_the_same_frequencies():
    from tiny_lean import LeanTiny
    from tiny_model import build_config, yarn_parameters

    geo = small_geometry(256)
    cfg = build_config(
        geo, bos_token_id=0, eos_token_id=1, rope_parameters=yarn_parameters(4.0, 64)
    ).to_dict()
    short, long = LeanTiny(cfg), LeanTiny(cfg, positions=320)
    assert short.cos.shape[0] == 256 and long.cos.shape[0] == 320
    assert torch.equal(long.cos[:256], short.cos) and torch.equal(long.sin[:256], short.sin)
    assert not torch.equal(long.cos[256:], long.cos[192:256])  # new positions, not a repeat
