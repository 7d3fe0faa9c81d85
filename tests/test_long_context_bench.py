"""bench/long_context.py's two parts give validate's own figures: the lean teacher-forced run the same
KL by position and attention flips as the full run, the generation part the same acceptance counters
and repeated n-grams."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from validate_helpers import local_config, tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("long_context_bench", ROOT / "bench/long_context.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_context_bench"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mlaq.validate.runner import measure
    from mlaq.validate.stats import summarize

    path = tiny_checkpoint(tmp_path_factory.mktemp("tiny_long"))
    cfg = local_config(
        path,
        schemes=("mxfp4",),
        windows=1,
        context_len=96,
        buckets=2,
        prompts=2,
        prompt_len=24,
        max_tokens=12,
    )
    return cfg, summarize(measure(cfg, noise_floor=None))


def test_lean_teacher_forced_keeps_kl_and_flips(bench, setup) -> None:
    from mlaq.validate.runner import measure
    from mlaq.validate.sources import windows
    from mlaq.validate.stats import summarize

    cfg, full = setup
    before = windows.attention_output
    with bench.lean_teacher_forced():
        lean = summarize(measure(cfg, noise_floor=None))
    assert windows.attention_output is before  # restored
    got, want = lean["schemes"]["mxfp4"], full["schemes"]["mxfp4"]
    assert got["kl_by_bucket"] == want["kl_by_bucket"] and got["kl"] > 0
    assert got["kld_stats"] == want["kld_stats"]
    assert got["flip_rate"] == want["flip_rate"] and got["attention_tv"] == want["attention_tv"]
    assert "attn_rel_err" in want and "attn_rel_err" not in got  # the replay did not run
    assert "bmm_rel_err" in want and "bmm_rel_err" not in got  # nor the per-op figures
    assert got["schemes"] == want["schemes"]


def test_generation_part_gives_validates_counters(bench, setup, tmp_path) -> None:
    cfg, full = setup
    out = bench.generation(argparse.Namespace(out=tmp_path), cfg)
    assert (tmp_path / "generation.json").is_file()
    for got, want in (
        (out["reference"], full["reference"]),
        (out["schemes"]["mxfp4"], full["schemes"]["mxfp4"]),
    ):
        for key in ("num_draft_tokens", "num_accepted_tokens", "acceptance_rate"):
            assert got[key] == want[key], key
        assert list(got["generation"]["per_prompt_repeated_ngram_share"]) == list(
            want["generation"]["per_prompt_repeated_ngram_share"]
        )
    got, want = out["schemes"]["mxfp4"], full["schemes"]["mxfp4"]
    assert list(got["acceptance_ratio_ci"]) == list(want["acceptance_ratio_ci"])
    assert list(got["generation"]["first_divergence"]) == list(want["generation"]["first_divergence"])
