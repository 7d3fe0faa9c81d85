"""How KL figures from a server are worded: which estimator, "exact" only when every position is, no
standard error from a handful of positions."""

from __future__ import annotations

import numpy as np

from mlaq.cli.validate_output import server_notes
from mlaq.validate.kld import MIN_N_UNCERTAINTY, format_kld_statistics, kld_statistics, pm
from mlaq.validate.topk_kl import estimate_words, logprobs_label


def test_logprobs_label() -> None:
    assert logprobs_label(20) == "top-20"
    assert logprobs_label(-1) == "full-vocabulary"  # never "top--1"


def test_exact_only_when_every_position_is() -> None:
    almost = {"exact": False, "exact_share": 0.998}
    assert (
        estimate_words(almost, -1) == "full-vocabulary estimate, a lower bound, exact at 99.8 % of positions"
    )
    assert estimate_words({"exact": True, "exact_share": 1.0}, -1).startswith("exact")
    assert estimate_words({"exact": False, "exact_share": 0.0}, 20) == "top-20 estimate, a lower bound"


def test_no_standard_error_below_the_minimum_positions() -> None:
    assert pm(0.0, MIN_N_UNCERTAINTY - 1, ".1e") == "± n/a"
    assert pm(1e-3, MIN_N_UNCERTAINTY, ".1e") == "± 1.0e-03"
    few = kld_statistics(np.full(4, 0.1), np.zeros(4), np.ones(4), np.zeros(4))
    assert "± n/a" in format_kld_statistics(few)[0] and "± n/a" in format_kld_statistics(few)[-1]


def test_server_notes_name_the_estimator() -> None:
    est = {"exact": False, "exact_share": 0.998, "mass_outside_mean": 1e-7, "mass_outside_max": 2e-6}
    decode = {"n": 4, "kld": {"mean": 0.1, "uncertainty": 0.0, "max": 0.2}, "top1_agreement": 1.0}
    mc = {
        "k1": {"kl": 0.93, "ci": [0.73, 1.18], "sequences": 64, "positions": 4096},
        "k3": {"kl": 0.94, "ci": [0.72, 1.23], "sequences": 64, "positions": 4096},
        "topk_kl": 1.07,
        "topk_exact_share": 1.0,
        "topk_is_exact": True,
    }
    report = {
        "model": {"servers": {"candidate": {}, "reference": None}},
        "config": {"logprobs": -1},
        "schemes": {"cand": {"decode": {**decode, "kl_estimator": est}, "mc_kl": mc}},
    }
    text = "\n".join(server_notes(report) or [])
    assert "top--1" not in text and "± 0.0" not in text
    assert "mean KLD 0.100000 ± n/a" in text
    assert "(KL: full-vocabulary estimate, a lower bound, exact at 99.8 % of positions)" in text
    assert "k1 (log-ratio) 0.9300 [0.7300, 1.1800]" in text and "k3 ((r - 1) - log r) 0.9400" in text
    assert "full-vocabulary KL at the same positions 1.0700 (exact)" in text
