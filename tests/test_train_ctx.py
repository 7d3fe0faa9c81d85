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

from ctx_data import Mix, copy_window, kv_window, make_window
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
            w1 = make_window(streams, n, tok, np.random.default_rng(seed), Mix())
            w2 = make_window(streams, n, tok, np.random.default_rng(seed), Mix())
            assert len(w1) == n + 1 and np.array_equal(w1, w2)


def test_kv_window_queries_facts_stated_earlier(tok):
    hay = list(range(1000, 3000))  # ids above the vocabulary spell nothing: only the task's text decodes
    for seed in range(10):
        w = kv_window(hay, 1024, tok, np.random.default_rng(seed))
        assert len(w) == 1025
        text = tok.decode([i for i in w if i < 400])
        last = text.strip().splitlines()[-1]
        keys = re.findall(r"[a-z]+(?:_[a-z0-9]+)+", last)
        assert keys and all(text.count(k) >= 2 for k in keys), (last, text[:300])


def test_copy_window_repeats_a_segment(tok):
    hay = list(range(1000, 1600))  # no 24-token run repeats in the haystack itself
    for seed in range(10):
        w = list(copy_window(hay, 512, tok, np.random.default_rng(seed)))
        assert len(w) == 513
        runs = {tuple(w[i : i + 24]) for i in range(len(w) - 24)}
        assert len(runs) < len(w) - 24, f"seed {seed}: no repeated 24-token segment"
