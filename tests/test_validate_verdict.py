"""The verdict per scheme from summarized figures (hand-built, no model)."""

from __future__ import annotations

import pytest

from mlaq.validate.intervals import min_detectable_drop
from mlaq.validate.verdict import VerdictConfig, holm, samples_needed, verdict


def cell(n: int, ref_right: int, cand_right: int, only_ref: int, only_cand: int, lp=(0.0, -0.01, 0.01)):
    from mlaq.validate.intervals import mcnemar_exact

    return {
        "n": n,
        "accuracy": cand_right / n,
        "accuracy_delta": (cand_right - ref_right) / n,
        "p_value_vs_bf16": mcnemar_exact(only_ref, only_cand),
        "logprob_delta": lp[0],
        "logprob_delta_ci": [lp[1], lp[2]],
        "min_detectable_drop": min_detectable_drop(n, ref_right / n),
    }


REF = {"acceptance_rate": 0.5}


def scheme(cells: dict, kl=1e-4, acceptance=0.5) -> dict:
    return {"tasks": cells, "kl": kl, "acceptance_rate": acceptance}


def test_significant_drop_is_degraded() -> None:
    v = verdict(scheme({"needle": {"2048": cell(40, 38, 28, 10, 0)}}), REF, 8)
    assert v["verdict"] == "degraded" and "needle at 2048" in v["reasons"][0]


def test_same_answers_with_power_is_ok() -> None:
    v = verdict(
        scheme({"needle": {"512": cell(2000, 1980, 1980, 3, 3), "4096": cell(2000, 1900, 1899, 4, 3)}}),
        REF,
        8,
    )
    assert v["verdict"] == "ok", v
    assert v["min_detectable_drop"] == pytest.approx(min_detectable_drop(2000, 0.95))


def test_too_few_samples_is_inconclusive_and_says_how_many() -> None:
    v = verdict(scheme({"copy": {"2048": cell(10, 9, 9, 0, 0)}}), REF, 8)
    assert v["verdict"] == "inconclusive"
    need = samples_needed(0.9, 0.05)
    assert f"--task-samples copy={need}" in v["reasons"][0]
    assert min_detectable_drop(need, 0.9) <= 0.05 < min_detectable_drop(need - 1, 0.9)


def test_reference_that_cannot_do_the_task_is_inconclusive() -> None:
    v = verdict(scheme({"multikey": {"2048": cell(500, 0, 0, 0, 0)}}), REF, 8)
    assert v["verdict"] == "inconclusive"
    assert v["reasons"] == ["no task is measurable on this model: multikey at 2048 (bf16 0 %, n=500)"]
    assert verdict(scheme({}), REF, 8)["reasons"] == ["no long-context task ran"]


def test_a_task_bf16_cannot_do_is_not_measurable_and_the_verdict_rests_on_the_others() -> None:
    cells = {
        "needle": {"4096": cell(2000, 1900, 1899, 4, 3)},
        "copy": {"1024": cell(4, 1, 1, 0, 0), "4096": cell(4, 0, 0, 0, 0)},  # bf16 0-25 %: no drop can show
        "vartrack": {"4096": cell(40, 2, 0, 2, 0)},  # bf16 5 %
    }
    v = verdict(scheme(cells), REF, 8)
    assert v["verdict"] == "ok", v
    assert v["measured_tasks"] == ["needle at 4096"]
    assert v["not_measurable"] == ["copy at 4096 (bf16 0 %, n=4)", "vartrack at 4096 (bf16 5 %, n=40)"]
    assert "not measurable on this model: copy at 4096 (bf16 0 %, n=4)" in v["reason"]
    assert v["reason"].startswith("no drop on needle at 4096")
    # the smallest detectable drop is the measured tasks' (copy's n=4 would detect nothing)
    assert v["min_detectable_drop"] == pytest.approx(min_detectable_drop(2000, 0.95))


def test_a_shorter_length_bf16_can_do_is_measured_instead() -> None:
    cells = {"needle": {"1024": cell(2000, 1900, 1900, 3, 3), "4096": cell(10, 0, 0, 0, 0)}}
    v = verdict(scheme(cells), REF, 8)
    assert v["verdict"] == "ok" and v["measured_tasks"] == ["needle at 1024"]


@pytest.mark.parametrize(
    ("n", "lp", "status", "reason"),
    [
        (32, (-0.01, -0.05, 0.02), "ok", "answer log-prob within 0.1 nats of bf16"),
        (32, (-0.05, -0.3, 0.1), "inconclusive", "reaches below -0.1"),  # not equivalent, not degraded
        (10, (-0.01, -0.05, 0.02), "inconclusive", "--task-samples needle="),  # too few for the bootstrap
    ],
)
def test_answer_logprob_equivalence_gives_ok_where_exact_match_has_no_power(n, lp, status, reason) -> None:
    c = cell(n, n, n, 0, 0, lp=lp)  # bf16 and the scheme always right: MDE 6 / n > 0.05
    assert c["min_detectable_drop"] > 0.05
    v = verdict(scheme({"needle": {"4096": c}, "multikey": {"4096": c}}), REF, 8)
    assert v["verdict"] == status, v
    assert any(reason in r for r in v["reasons"]), v["reasons"]
    if status == "ok":
        assert v["reason"] == (
            "no drop on needle at 4096, multikey at 4096 (accuracy drops >= 19 pts excluded, "
            "answer log-prob equivalent)"
        )


@pytest.mark.parametrize(
    ("kl", "acceptance", "prompts", "status", "reason"),
    [
        (0.05, 0.5, 8, "degraded", "mean KL"),
        (1e-4, 0.45, 8, "degraded", "< 0.95 x bf16"),
        (1e-4, 0.65, 8, "degraded", "repetition makes drafting easy"),
        (1e-4, 0.45, 4, "ok", None),  # fewer than 5 prompts: acceptance is not compared
    ],
)
def test_kl_and_acceptance(kl, acceptance, prompts, status, reason) -> None:
    ok_cells = {"needle": {"4096": cell(2000, 1900, 1900, 5, 5)}}
    v = verdict(scheme(ok_cells, kl=kl, acceptance=acceptance), REF, prompts)
    assert v["verdict"] == status
    if reason:
        assert any(reason in r for r in v["reasons"]), v["reasons"]


def test_logprob_drop_with_its_interval_below_the_threshold() -> None:
    bad = cell(2000, 1900, 1900, 5, 5, lp=(-0.5, -0.6, -0.4))
    assert verdict(scheme({"needle": {"4096": bad}}), REF, 8)["verdict"] == "degraded"
    noisy = cell(2000, 1900, 1900, 5, 5, lp=(-0.5, -0.9, 0.05))
    assert verdict(scheme({"needle": {"4096": noisy}}), REF, 8)["verdict"] == "ok"


def test_holm() -> None:
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    # five cells at p = 0.02 each: none survives the correction
    cells = {"needle": {str(n): cell(40, 30, 24, 6, 0) for n in (512, 1024, 2048, 4096, 8192)}}
    assert cells["needle"]["512"]["p_value_vs_bf16"] == pytest.approx(2 / 64)
    assert verdict(scheme(cells), REF, 8)["verdict"] != "degraded"


def test_bad_config() -> None:
    with pytest.raises(ValueError, match="--max-drop"):
        VerdictConfig(max_drop=0)


@pytest.mark.parametrize(
    ("ci", "status", "reason"),
    [
        ((0.70, 1.10), "ok", None),  # 0.45 / 0.5 = 0.9 as a point, but the interval reaches 0.95: noise
        ((0.80, 0.92), "degraded", "95 % CI 0.80-0.92) < 0.95 x bf16"),
        ((0.0, 0.0), "degraded", "< 0.95 x bf16"),  # a collapse (GLM-5.2 MXFP4: 58.5 % -> 0 %)
    ],
)
def test_acceptance_is_judged_on_its_paired_interval(ci, status, reason) -> None:
    ok_cells = {"needle": {"4096": cell(2000, 1900, 1900, 5, 5)}}
    v = verdict({**scheme(ok_cells, acceptance=0.45), "acceptance_ratio_ci": list(ci)}, REF, 8)
    assert v["verdict"] == status, v
    assert v["acceptance_ratio_ci"] == list(ci)
    if reason:
        assert any(reason in r for r in v["reasons"]), v["reasons"]
