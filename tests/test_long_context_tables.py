"""bench/long_context_tables.py: the long-window tables read the counts validate measured, no more."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mlaq.validate.flips import sample_rows
from mlaq.validate.intervals import wilson

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location(
        "long_context_tables", ROOT / "bench/long_context_tables.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_context_tables"] = module
    spec.loader.exec_module(module)
    return module


def _report(context: int = 1024, rows: int = 64) -> dict:
    buckets = [[0, 512], [512, 1024]]
    kld = [{"kld": {"mean": 0.001, "uncertainty": 0.0001}}, {"kld": {"mean": 0.003, "uncertainty": 0.0002}}]
    scheme = {
        "kld_stats": {"buckets": kld},
        "flip_rate": {"0": {"512": 0.25, "1024": 0.0}, "1": {"512": 0.0, "1024": 0.5}},
        "num_draft_tokens": 100,
        "num_accepted_tokens": 40,
        "acceptance_ratio_ci": [0.7, 0.9],
        "generation": {"per_prompt_repeated_ngram_share": [0.5, 0.0], "identical_generations": 1},
    }
    return {
        "config": {
            "context_len": context,
            "windows": 1,
            "flip_rows": rows,
            "num_speculative_tokens": 3,
            "ngram": 4,
            "max_tokens": 11,  # 8 four-grams per generation
            "prompts": 2,
            "prompt_len": 100,
        },
        "model": {"num_attention_heads": 4, "num_hidden_layers": 1},
        "buckets": buckets,
        "noise_floor": None,
        "reference": {
            "num_draft_tokens": 100,
            "num_accepted_tokens": 50,
            "acceptance_rate": 0.5,
            "generation": {"per_prompt_repeated_ngram_share": [0.25, 0.0]},
        },
        "schemes": {"mxfp4": scheme},
    }


def test_flip_counts_are_validates_sampled_rows_times_heads(tables) -> None:
    report = _report()
    rows = sample_rows(1024, 64).tolist()
    got = tables.flip_counts(report, report["schemes"]["mxfp4"], "0")
    first = 4 * sum(r < 512 for r in rows)
    assert [n for _, n in got] == [first, 4 * len(rows) - first]
    assert got[0][0] == pytest.approx(0.25 * first)
    # every row sampled (rows >= context): the MTP layer's window is one token shorter
    every = _report(rows=4096)
    assert [n for _, n in tables.flip_counts(every, every["schemes"]["mxfp4"], "0")] == [4 * 512, 4 * 512]
    assert [n for _, n in tables.flip_counts(every, every["schemes"]["mxfp4"], "1")] == [4 * 512, 4 * 511]


def test_cells_carry_the_wilson_interval_and_the_kl_difference(tables) -> None:
    report = _report()
    kl = "\n".join(tables.kl_table(report))
    assert "+2.00e-03" in kl  # last - first
    lo, hi = wilson(40, 100)
    gen = "\n".join(tables.generation_table(report))
    assert f"40.0 % [{100 * lo:.1f}, {100 * hi:.1f}], 100" in gen
    assert "0.800 [0.700, 0.900]" in gen  # 0.4 / 0.5 and validate's paired interval
    lo, hi = wilson(4, 16)  # 4 of 8 four-grams repeated in the first prompt, none in the second
    assert f"25.0 % [{100 * lo:.1f}, {100 * hi:.1f}], 16" in gen
    assert "1 of 2" in gen
