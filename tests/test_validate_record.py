"""The measurement record and the statistics over it, with no model: a record built by hand (as a
server source that measures only logits and generations would fill it) summarizes to known figures,
and every renderer works from the summary alone."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from mlaq.validate.config import ValidateConfig
from mlaq.validate.record import GenerationRecord, LayerRef, Record, SpecCounts, Totals, VariantRecord
from mlaq.validate.report_md import render_markdown
from mlaq.validate.runner import measure
from mlaq.validate.shape import RunShape
from mlaq.validate.stats import bucket_mean, ratio_rms, summarize
from mlaq.validate.summary import format_plain, print_summary

CONFIG = {
    "schemes": ["mxfp4"], "as_configured": False, "settings": None, "quantization_config": None,
    "precision": "decode_only", "context_len": 8, "windows": 2, "buckets": 2, "prompts": 2,
    "prompt_len": 4, "max_tokens": 4, "num_speculative_tokens": 2, "ngram": 2, "threads": 1,
}  # fmt: skip


def _t(sums: list[list[float]], counts: list[list[float]]) -> Totals:
    return Totals(sums, counts)


def hand_record(with_layers: bool = True) -> Record:
    ref_gen = GenerationRecord([[1, 2, 3, 4], [5, 6, 7, 8]], 0.5, SpecCounts(4, 8, 6, [4, 2]), "a b c d")
    cand_gen = GenerationRecord([[1, 2, 1, 2], [5, 6, 7, 8]], 0.5, SpecCounts(5, 10, 4, [3, 1]), "a b a b")
    positions = {
        "kl": _t([[1.0, 3.0], [1.0, 3.0]], [[2, 2], [2, 2]]),
        "top1": _t([[2.0, 1.0], [2.0, 2.0]], [[2, 2], [2, 2]]),
        "nll_delta": _t([[0.2, 0.4], [0.2, 0.4]], [[2, 1], [2, 1]]),
    }
    layers = []
    if with_layers:
        positions["attn_diff2/0"] = _t([[4.0, 0.0], [0.0, 0.0]], [[2, 2], [2, 2]])
        positions["attn_ref2/0"] = _t([[50.0, 50.0], [50.0, 50.0]], [[2, 2], [2, 2]])
        layers = [LayerRef(0, False)]
    ref = VariantRecord(
        "bf16", "reference", "bfloat16", {"bf16": "bf16"},
        {"nll": _t([[6.0, 2.0], [6.0, 2.0]], [[2, 1], [2, 1]])}, generation=ref_gen,
    )  # fmt: skip
    cand = VariantRecord(
        "mxfp4", "scheme", "bfloat16", {"mxfp4": "W4A4"}, positions, layers, generation=cand_gen
    )
    return Record(
        model={
            "path": "hand", "model_type": "deepseek_v3", "num_hidden_layers": 1, "num_mtp_layers": 0,
            "num_attention_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2,
            "v_head_dim": 4, "max_position_embeddings": 8, "checkpoint_dtype": "bfloat16",
        },
        eval_text={
            "path": "t.txt", "sha256": "0" * 64, "bytes": 10, "tokens": 16, "window_starts": [0, 8],
            "prompt_starts": [0, 4], "prompt_sample": "x",
        },
        config=CONFIG, seed=0, versions={"mlaq": "0", "torch": "0", "python": "3", "platform": "p"},
        buckets=[[0, 4], [4, 8]], reference=ref, noise_floor=None, candidates=[cand], operands={},
        timings={"total": 1.0}, source="hand",
    )  # fmt: skip


def test_pooled_statistics_are_exact() -> None:
    assert bucket_mean(_t([[1.0, 3.0], [1.0, 3.0]], [[2, 2], [2, 2]])) == ([0.5, 1.5], 1.0)
    assert bucket_mean(_t([[1.0, 0.0]], [[1, 0]])) == ([1.0, None], 1.0)  # an empty bucket
    per, overall = ratio_rms(_t([[4.0, 0.0], [0.0, 0.0]], [[1, 1]] * 2), _t([[50.0, 50.0]] * 2, [[1, 1]] * 2))
    assert per == [0.2, 0.0] and overall == pytest.approx(math.sqrt(4 / 200))


def test_summary_of_a_hand_record() -> None:
    r = summarize(hand_record())
    s = r["schemes"]["mxfp4"]
    assert s["kl"] == 1.0 and s["kl_by_bucket"] == (0.5, 1.5)
    assert s["top1_agreement"] == pytest.approx(7 / 8) and s["nll_delta_by_bucket"] == (0.1, 0.4)
    assert s["attn_rel_err"] == pytest.approx(math.sqrt(4 / 200)) and s["attn_rel_err_by_bucket"] == (
        0.2,
        0.0,
    )
    assert (
        s["num_accepted_tokens"] == 4 and s["acceptance_rate"] == 0.4 and s["mean_acceptance_length"] == 1.8
    )
    assert s["generation"]["first_divergence"] == (2, None) and s["generation"]["identical_generations"] == 1
    assert r["reference"]["nll"] == pytest.approx(16 / 6) and r["reference"]["nll_by_bucket"] == (3.0, 2.0)
    assert "bmm_rel_err" not in s and r["noise_floor"] is None and r["operands"] == {}


def test_a_source_without_per_layer_figures_still_reports() -> None:
    """A source that cannot see inside the model (a server) leaves layers and ops empty; the
    report simply has no attention-error figures, and every renderer copes."""
    r = summarize(hand_record(with_layers=False))
    s = r["schemes"]["mxfp4"]
    assert "attn_rel_err" not in s and s["kl"] == 1.0
    md = render_markdown(r, [])
    assert "| mxfp4 |" in md and "## Attention error by layer" not in md
    assert "mxfp4" in format_plain(r)
    out = io.StringIO()
    print_summary(r, out, use_rich=False)
    assert "bf16 (reference)" in out.getvalue()


def test_plots_from_a_hand_record(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from mlaq.validate.plots import write_plots

    names = write_plots(summarize(hand_record()), tmp_path)
    assert set(names) == {"error_vs_position.png", "acceptance_per_position.png", "per_layer_error.png"}


def test_round_trip_and_version() -> None:
    rec = hand_record()
    assert Record.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    bad = {**rec.to_json(), "record_version": 99}
    with pytest.raises(ValueError, match="record version 99"):
        Record.from_json(bad)


def test_measure_takes_any_source() -> None:
    class Recorded:
        name = "hand"

        def measure(self, progress):
            return hand_record()

    cfg = ValidateConfig(model=Path("unused"), shape=RunShape(eval_text=Path("unused")))
    assert measure(cfg, source=Recorded()) == hand_record()


def test_acceptance_ratio_interval_from_per_prompt_counts() -> None:
    """With per-prompt counts on both sides the summary and the verdict carry the paired interval;
    without them (a server's /metrics totals) it is None and the verdict uses the point estimate."""
    r = hand_record()
    assert summarize(r)["schemes"]["mxfp4"]["acceptance_ratio_ci"] is None
    ref, cand = r.reference, r.candidates[0]
    ref_gen = replace(ref.generation, spec=SpecCounts(4, 8, 6, [4, 2], [[4, 3], [4, 3]]))
    cand_gen = replace(cand.generation, spec=SpecCounts(5, 10, 4, [3, 1], [[5, 2], [5, 2]]))
    r = replace(
        r, reference=replace(ref, generation=ref_gen), candidates=[replace(cand, generation=cand_gen)]
    )
    s = summarize(r)["schemes"]["mxfp4"]
    want = (4 / 10) / (6 / 8)  # both prompts alike: every resample gives the pooled ratio
    assert s["acceptance_ratio_ci"] == pytest.approx([want, want])
    assert s["verdict"]["acceptance_ratio_ci"] == pytest.approx([want, want])
