"""``mlaq compare``: two validate reports' task outcomes paired on the same samples."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from mlaq.cli.compare import format_text
from mlaq.validate.intervals import mcnemar_exact, wilson
from mlaq.validate.pairs import compare, load_side
from mlaq.validate.tasks.generators import TaskSample
from mlaq.validate.tasks.run import fingerprint

FAST = [
    "--context-len", "64", "--windows", "1", "--prompts", "1", "--prompt-len", "16", "--max-tokens", "4",
    "--num-speculative-tokens", "0", "--flip-rows", "8", "--tasks", "needle,multikey", "--lengths", "512",
    "--task-samples", "5", "--schemes", "mxfp4", "--no-progress",
]  # fmt: skip


def _sample(prompt: tuple[int, ...], answer: tuple[int, ...]) -> TaskSample:
    return TaskSample("needle", 8, 0, 0.0, prompt, answer, 0, 0, False)


def test_fingerprint_is_the_sha256_of_the_int32_token_ids() -> None:
    ids = (7, 300, 4095, 1)
    expected = hashlib.sha256(struct.pack("<4i", *ids)).hexdigest()[:16]  # an independent encoding
    assert fingerprint(_sample(ids[:3], ids[3:])) == expected
    assert fingerprint(_sample(ids[:2], ids[2:])) == expected  # where the answer starts is not the sample
    assert fingerprint(_sample((7, 300, 4095), (2,))) != expected


def _report(path, correct, logprob, fingerprints, name: str = "bf16", length: int = 64, extra: int = 0):
    """A report with ``extra`` multikey samples, then needle samples at ``length`` (depths 0, 0, 1, 1, 0)."""
    depths = [0.0, 0.0, 1.0, 1.0, 0.0][: len(correct) - extra]
    items = [
        {"task": "multikey", "length": 32, "index": k, "depth": 0.0, "fingerprint": f"{k:08x}m"}
        for k in range(extra)
    ] + [
        {"task": "needle", "length": length, "index": i, "depth": d, "fingerprint": f}
        for i, (d, f) in enumerate(zip(depths, fingerprints, strict=True))
    ]
    outcomes = {"correct": correct, "logprob": logprob, "token_accuracy": [float(c) for c in correct]}
    obj = {
        "model": {"path": f"/models/{name}"},
        "reference": {"name": name, "task_outcomes": outcomes},
        "schemes": {},
        "tasks": {"samples": len(items), "items": items},
    }
    path.write_text(json.dumps(obj))
    return path


FPS = [f"{i:016x}" for i in range(5)]


def test_pairs_count_the_discordant_samples_per_cell_and_depth(tmp_path) -> None:
    a = _report(tmp_path / "a.json", [True, True, False, False, True], [-0.1, -0.2, -3.0, -2.0, -0.1], FPS)
    b = _report(tmp_path / "b.json", [True, False, True, True, True], [-0.1, -1.0, -0.5, -0.4, 0.0], FPS)
    out = compare(load_side(a), load_side(b))
    cell = out["cells"]["needle"]["64"]
    assert (cell["n"], cell["only_a"], cell["only_b"]) == (5, 1, 2)
    assert cell["p_value"] == mcnemar_exact(1, 2)
    assert cell["a"]["correct"] == 3 and cell["b"]["correct"] == 4
    assert cell["b"]["ci"] == list(wilson(4, 5))
    assert cell["accuracy_delta"] == pytest.approx(0.2)
    assert cell["logprob_delta"] == pytest.approx((0 - 0.8 + 2.5 + 1.6 + 0.1) / 5)
    lo, hi = cell["logprob_delta_ci"]
    assert lo <= cell["logprob_delta"] <= hi
    depth = out["needle_by_depth"]["64"]
    assert list(depth) == ["0", "1"]
    assert (depth["0"]["n"], depth["0"]["only_a"], depth["0"]["only_b"]) == (3, 1, 0)
    assert (depth["1"]["n"], depth["1"]["only_a"], depth["1"]["only_b"]) == (2, 0, 2)


def test_reports_of_other_lengths_pair_on_the_samples_both_hold(tmp_path) -> None:
    """A 16K-only run against a run of several lengths: the shared cell is compared, sample for sample
    wherever the two orders differ, and what only one side holds is named, not dropped silently."""
    a = _report(tmp_path / "a.json", [False, False, True, True, False, False, True], [0.0] * 7, FPS, extra=2)
    b = _report(tmp_path / "b.json", [True, False, True, True, True], [0.0, -1.0, 0.0, 0.0, -0.5], FPS)
    out = compare(load_side(b), load_side(a))
    assert out["paired"] == 5 and list(out["cells"]) == ["needle"]
    assert out["a_only"] == [] and out["b_only"] == ["multikey at 32 tokens, 2 samples"]
    cell = out["cells"]["needle"]["64"]
    assert (cell["n"], cell["only_a"], cell["only_b"]) == (5, 2, 1)
    assert cell["logprob_delta"] == pytest.approx((0 + 1.0 + 0 + 0 + 0.5) / 5)
    shuffled = json.loads(b.read_text())
    order = [4, 2, 0, 3, 1]
    shuffled["tasks"]["items"] = [shuffled["tasks"]["items"][k] for k in order]
    for key, values in shuffled["reference"]["task_outcomes"].items():
        shuffled["reference"]["task_outcomes"][key] = [values[k] for k in order]
    (tmp_path / "s.json").write_text(json.dumps(shuffled))
    again = compare(load_side(tmp_path / "s.json"), load_side(a))["cells"]["needle"]["64"]
    assert (again["only_a"], again["only_b"], again["logprob_delta"]) == (2, 1, cell["logprob_delta"])
    text = format_text(out)
    assert "Only in B, left out: multikey at 32 tokens, 2 samples" in text and "Only in A" not in text


def test_different_samples_and_bad_reports_are_clear_errors(tmp_path) -> None:
    a = _report(tmp_path / "a.json", [True] * 5, [0.0] * 5, FPS)
    b = _report(tmp_path / "b.json", [True] * 5, [0.0] * 5, [*FPS[:3], "f" * 16, FPS[4]])
    with pytest.raises(ValueError, match=r"different samples.*sample 3.*same --needle-depths, --seed"):
        compare(load_side(a), load_side(b))
    c = _report(tmp_path / "c.json", [True] * 5, [0.0] * 5, FPS, length=128)
    with pytest.raises(ValueError, match=r"share no task sample.*one task and length in common"):
        compare(load_side(a), load_side(c))
    with pytest.raises(ValueError, match="no variant 'mxfp4'; this report has bf16"):
        load_side(a, "mxfp4")
    with pytest.raises(ValueError, match="no such report"):
        load_side(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON report"):
        load_side(tmp_path / "bad.json")
    (tmp_path / "other.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not an mlaq validate report"):
        load_side(tmp_path / "other.json")
    old = json.loads(a.read_text())
    del old["tasks"]["items"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"no per-sample task outcomes.*run mlaq validate again"):
        load_side(tmp_path / "old.json")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two runs of the bundled model on the same samples (seed 0) and one on others (seed 1)."""
    from conftest import run_mlaq

    root = tmp_path_factory.mktemp("compare")
    for name, seed in (("a", "0"), ("b", "1")):
        res = run_mlaq("validate", *FAST, "--seed", seed, "--out", str(root / name))
        if res.returncode != 0 and "bundled" in res.stderr:
            pytest.skip("the bundled mlaq-tiny-4k asset is not in this checkout")
        assert res.returncode == 0, res.stderr
    return root


def test_compare_agrees_with_validates_own_paired_cells(mlaq_cli, reports) -> None:
    """One report against itself, bf16 against mxfp4: the same counts and p-values as validate's table."""
    res = mlaq_cli(
        "compare",
        str(reports / "a"),
        str(reports / "a" / "report.json"),
        "--variants",
        "bf16,mxfp4",
        "--json",
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    report = json.loads((reports / "a" / "report.json").read_text())
    for task in ("needle", "multikey"):
        mine, theirs = out["cells"][task]["512"], report["schemes"]["mxfp4"]["tasks"][task]["512"]
        assert (mine["n"], mine["b"]["correct"]) == (theirs["n"], theirs["correct"])
        assert (mine["only_a"], mine["only_b"]) == (theirs["only_reference"], theirs["only_candidate"])
        assert mine["p_value"] == theirs["p_value_vs_bf16"]
        assert mine["logprob_delta"] == pytest.approx(theirs["logprob_delta"])
    depths = out["needle_by_depth"]["512"]
    assert sum(c["n"] for c in depths.values()) == 5 and len(depths) == 5
    text = mlaq_cli("compare", str(reports / "a"), str(reports / "a"))
    assert text.returncode == 0 and "needle by depth at 512 tokens" in text.stdout
    assert "+0.000 [+0.000, +0.000]" in text.stdout  # bf16 against itself: no change


def test_compare_refuses_reports_of_other_samples(mlaq_cli, reports) -> None:
    res = mlaq_cli("compare", str(reports / "a"), str(reports / "b"))
    assert res.returncode == 2 and "different samples" in res.stderr and "--seed" in res.stderr
    assert "Traceback" not in res.stderr
    res = mlaq_cli("compare", str(reports / "a"), str(reports / "a"), "--variants", "bf16,nope")
    assert res.returncode == 2 and "no variant 'nope'" in res.stderr and "mxfp4" in res.stderr
