"""``run_validation`` end to end on tiny random checkpoints: the JSON's shape, exactness of the
fp32-vs-fp32 comparison, schemes above the noise floor, per-op error near theory, as-configured."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from mlaq.validate.config import NOISE_FLOOR, Variant, VariantKind
from mlaq.validate.record import Record
from mlaq.validate.runner import measure, run_validation
from mlaq.validate.stats import summarize
from validate_helpers import PER_SCHEME, local_config, reshaped, tiny_checkpoint

SMALL = {
    "context_len": 64,
    "windows": 2,
    "buckets": 4,
    "prompts": 2,
    "prompt_len": 16,
    "max_tokens": 8,
    "num_speculative_tokens": 2,
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_v3"))


@pytest.fixture(scope="module")
def record(checkpoint):
    cfg = local_config(
        checkpoint,
        schemes=("fp8_per_tensor", "mxfp4"),
        as_configured=True,
        quantization_config='{"targets": {"re:.*kv_b_proj": "mxfp4"}}',
        **SMALL,
    )
    return measure(cfg)


@pytest.fixture(scope="module")
def report(record):
    return summarize(record)


def test_the_record_round_trips_through_json(record, report) -> None:
    """The record is plain data: JSON text and back gives the same record and the same report."""
    again = Record.from_json(json.loads(json.dumps(record.to_json(), allow_nan=False)))
    assert again == record and summarize(again) == report
    assert record.source == "engine" and [v.name for v in record.candidates] == [
        "fp8_per_tensor",
        "mxfp4",
        "as-configured",
    ]
    # windows stay apart in the record: 2 windows x 4 buckets of every per-position quantity
    kl = record.candidates[1].positions["kl"]
    assert len(kl.sums) == len(kl.counts) == 2 and all(len(row) == 4 for row in kl.sums)
    assert sum(map(sum, kl.counts)) == 2 * 64


def test_report_shape_and_keys(report) -> None:
    json.dumps(report.to_json(), allow_nan=False)  # strict JSON
    assert set(report["schemes"]) == {"fp8_per_tensor", "mxfp4"}
    for name, s in [*report["schemes"].items(), ("noise floor", report["noise_floor"])]:
        for key in PER_SCHEME:
            assert isinstance(s[key], float) and math.isfinite(s[key]), (name, key)
        assert len(s["attn_rel_err_by_bucket"]) == len(s["kl_by_bucket"]) == 4
        layers = s["attn_rel_err_by_layer"]
        assert [x["layer"] for x in layers] == [0, 1, 2] and [x["mtp"] for x in layers] == [
            False,
            False,
            True,
        ]
        assert len(s["per_position_acceptance_rate"]) == 2
        # k = 2 drafts per step, fewer near max_tokens (at most max_tokens - 1 per step, as vLLM's scheduler):
        # accepted drafts never exceed the tokens emitted after each prompt's first
        assert s["num_drafts"] <= s["num_draft_tokens"] <= 2 * s["num_drafts"]
        assert s["num_accepted_tokens"] <= SMALL["prompts"] * (SMALL["max_tokens"] - 1)
        assert len(s["generation"]["first_divergence"]) == 2
        low, high = s["acceptance_ratio_ci"]  # paired over the prompts' own counts
        assert low <= s["acceptance_rate"] / report["reference"]["acceptance_rate"] <= high
    ref = report["reference"]
    assert ref["name"] == "bf16" and ref["schemes"] == {"bf16": ref["schemes"]["bf16"]}
    for key in ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance_rate", "num_drafts"):
        assert ref[key] is not None, key
    assert ref["mean_acceptance_length"] == pytest.approx(1 + ref["num_accepted_tokens"] / ref["num_drafts"])
    assert report["noise_floor"]["dtype"] == "float32" and report["noise_floor"]["name"] == "fp32"
    assert report["schemes"]["mxfp4"]["schemes"]["mxfp4"].startswith("AMD W4A4 MXFP4")
    assert report["buckets"] == ((0, 16), (16, 32), (32, 48), (48, 64))
    assert report["config"]["context_len"] == 64 and report["seed"] == 0
    assert {"mlaq", "torch", "python"} <= set(report["versions"])


def test_schemes_sit_above_the_noise_floor(report) -> None:
    floor = report["noise_floor"]
    for name in ("fp8_per_tensor", "mxfp4"):
        s = report["schemes"][name]
        assert s["attn_rel_err"] > 2 * floor["attn_rel_err"], (name, s["attn_rel_err"], floor["attn_rel_err"])
        assert s["kl"] > floor["kl"], name
    assert report["schemes"]["mxfp4"]["attn_rel_err"] > report["schemes"]["fp8_per_tensor"]["attn_rel_err"]


def test_mxfp4_per_op_error_near_theory_on_random_weights(report) -> None:
    """Random weights: activations do not line up with weights (gain ~ 1), so a W4A4 MXFP4 BMM's
    error sits at the Gaussian theory, sqrt(2) x 11.19 % = 15.8 %."""
    s = report["schemes"]["mxfp4"]
    for gains in report["operands"].values():
        assert 0.7 < gains["gain_uk"] < 1.4 and 0.7 < gains["gain_uv"] < 1.4
    for key, err in s["bmm_rel_err"].items():
        assert 0.13 < err < 0.19, (key, err)
        assert err / s["theory_bmm_rel_err_aligned"][key] == pytest.approx(1.0, abs=0.15)
    assert s["weight_rel_err"]["w_uk"] == pytest.approx(0.1119, abs=0.01)  # MXFP4 EVEN on Gaussians
    for layer in s["attn_rel_err_by_layer"]:  # the attention output carries about the BMMs' error
        assert 0.08 < layer["rel_err"] < 0.3, layer


def test_as_configured_with_mxfp4_targets_equals_the_mxfp4_scheme(report) -> None:
    """The policy route (targets -> loader -> per-layer decisions) and the direct re-preparation
    must run the same arithmetic: every figure identical."""
    ac, mx = report["as_configured"], report["schemes"]["mxfp4"]
    assert {d["scheme"] for d in ac["decisions"]} == {"mxfp4"} and len(ac["decisions"]) == 3
    for key in (*PER_SCHEME, "attn_rel_err_by_layer", "kl_by_bucket", "bmm_rel_err", "generation"):
        if key == "generation":
            assert ac[key]["first_divergence"] == mx[key]["first_divergence"]
        else:
            assert ac[key] == mx[key], key


def test_fp32_against_itself_is_exactly_zero(checkpoint) -> None:
    """The same variant on both sides: zero error, zero KL, full agreement, identical generations and
    acceptance. Fails if the per-layer replay does not reproduce the captured run bit for bit."""
    fp32 = Variant("fp32", VariantKind.REFERENCE, torch.float32, "fp32")
    cfg = local_config(checkpoint, schemes=("fp32",), **SMALL)
    r = run_validation(cfg, reference=fp32, noise_floor=NOISE_FLOOR)
    for s in (r["schemes"]["fp32"], r["noise_floor"]):
        assert s["attn_rel_err"] == 0.0 and all(x["rel_err"] == 0.0 for x in s["attn_rel_err_by_layer"])
        assert s["kl"] == 0.0 and s["nll_delta"] == 0.0 and s["top1_agreement"] == 1.0
        assert max(s["bmm_rel_err"].values()) < 1e-7  # against the exact product: fp32 rounding only
        assert s["generation"]["first_divergence"] == (None, None)
        for key in ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos"):
            assert s[key] == r["reference"][key], key


def test_dsa_checkpoint_replays_its_key_masks(tmp_path) -> None:
    """glm_moe_dsa: each layer attends to its DSA top-k selection; the replay must use the captured
    masks (fp32 against itself stays exactly zero) and the schemes still measure above zero."""
    ckpt = tiny_checkpoint(tmp_path / "dsa", "glm_moe_dsa")
    fp32 = Variant("fp32", VariantKind.REFERENCE, torch.float32, "fp32")
    small = {**SMALL, "windows": 1, "prompts": 1}
    cfg = local_config(ckpt, schemes=("fp32", "mxfp4"), **small)
    r = run_validation(cfg, reference=fp32, noise_floor=None)
    assert r["noise_floor"] is None
    assert r["schemes"]["fp32"]["attn_rel_err"] == 0.0 and r["schemes"]["fp32"]["kl"] == 0.0
    assert r["schemes"]["mxfp4"]["attn_rel_err"] > 0.05


def test_precision_consistent_changes_only_prefill(checkpoint) -> None:
    """Teacher forcing runs the absorbed path everywhere, so --precision cannot change it; prefill
    (naive path) then uses the scheme's weights, which the generation sees."""
    base = local_config(checkpoint, schemes=("mxfp4",), **{**SMALL, "windows": 1})
    from mlaq.model import Precision

    a = run_validation(base, noise_floor=None)
    b = run_validation(replace(base, precision=Precision.CONSISTENT), noise_floor=None)
    assert a["schemes"]["mxfp4"]["kl"] == b["schemes"]["mxfp4"]["kl"]
    assert b["config"]["precision"] == "consistent"


def test_without_speculation(checkpoint) -> None:
    cfg = local_config(
        checkpoint,
        schemes=("mxfp8",),
        **{**SMALL, "windows": 1, "num_speculative_tokens": 0},
    )
    r = run_validation(cfg, noise_floor=None)
    s = r["schemes"]["mxfp8"]
    assert s["acceptance_rate"] is None and s["mean_acceptance_length"] is None
    assert r["reference"]["num_drafts"] is None
    assert len(s["generation"]["first_divergence"]) == 2 and s["kl"] > 0


def test_a_checkpoint_without_mtp_weights_needs_k_0(tmp_path) -> None:
    ckpt = tiny_checkpoint(tmp_path / "no_mtp", mtp=False)
    cfg = local_config(ckpt, schemes=("mxfp4",), **SMALL)
    with pytest.raises(ValueError, match="--num-speculative-tokens 0"):
        run_validation(cfg)
    r = run_validation(reshaped(cfg, num_speculative_tokens=0, windows=1), noise_floor=None)
    layers = r["schemes"]["mxfp4"]["attn_rel_err_by_layer"]
    assert [x["mtp"] for x in layers] == [False, False]
