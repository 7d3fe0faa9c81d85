"""mlaq validate --server against fake OpenAI-compatible servers: A/B figures, recorded references,
acceptance from /metrics and per-request metrics, and one clear message per failure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mlaq.validate.server import ClientConfig, ServerError
from mlaq.validate.sources.server import run_server_validation
from server_fakes import VOCAB, Behaviour, FakeServer, fake_config, logprobs, write_text


@pytest.fixture
def text(tmp_path: Path) -> Path:
    return write_text(tmp_path)


_cfg = fake_config  # a small run against the fake server(s)


def _cand(r: dict) -> dict:
    """The one candidate's figures."""
    (v,) = r["schemes"].values()
    return v


def _srv(r: dict, side: str = "candidate") -> dict:
    return r["model"]["servers"][side]


def _exact_kl(windows: list[list[int]], noise: float) -> float:
    """Independent oracle: the exact mean KL(ref || cand) of the toy model over the same positions."""
    kls = []
    for w in windows:
        for t in range(1, len(w)):
            p, q = logprobs(w[:t], 0.0), logprobs(w[:t], noise)
            kls.append(float((np.exp(p) * (p - q)).sum()))
    return sum(kls) / len(kls)


def test_identical_servers_give_zero_kl_and_identical_tokens(text: Path) -> None:
    with FakeServer() as a, FakeServer() as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    c = _cand(r)
    assert c["kl"] == 0.0 and c["top1_agreement"] == 1.0 and c["nll_delta"] == 0.0
    assert c["generation"]["identical_generations"] == 3
    assert c["kld_stats"]["all"]["kld"]["max"] == 0.0
    assert _srv(r)["teacher_forcing"] == "prompt_logprobs" and r["source"] == "server"


def test_full_distribution_gives_the_exact_kl(text: Path) -> None:
    cand, ref = Behaviour(noise=1.0, max_logprobs=-1), Behaviour(max_logprobs=-1)
    with FakeServer(cand) as a, FakeServer(ref) as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=-1))
    c = _cand(r)
    assert c["kl_estimator"]["exact"] and c["kl_estimator"]["mass_outside_max"] < 1e-6
    windows = _windows(text)
    assert c["kl"] == pytest.approx(_exact_kl(windows, 1.0), rel=1e-9)
    assert 0 < c["top1_agreement"] < 1


def _windows(text: Path) -> list[list[int]]:
    from mlaq.validate.text import load_eval_text

    class Tok:
        def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(ch) % VOCAB for ch in s]

    data = load_eval_text(text, Tok(), context_len=48, windows=2, prompts=3, prompt_len=16, seed=0)  # type: ignore[arg-type]
    return [w[0].tolist() for w in data.windows()]


def test_topk_estimate_is_a_lower_bound_with_its_mass(text: Path) -> None:
    with FakeServer(Behaviour(noise=1.0)) as a, FakeServer() as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=3))
    c = _cand(r)
    exact = _exact_kl(_windows(text), 1.0)
    assert 0 < c["kl"] <= exact
    assert not c["kl_estimator"]["exact"] and c["kl_estimator"]["mass_outside_mean"] > 0


def test_echo_path_gives_the_same_figures_as_prompt_logprobs(text: Path) -> None:
    cfgs = (Behaviour(noise=0.5), Behaviour())
    with FakeServer(cfgs[0]) as a, FakeServer(cfgs[1]) as b:
        r1 = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=5))
    echo = (Behaviour(noise=0.5, prompt_logprobs=False), Behaviour(prompt_logprobs=False))
    with FakeServer(echo[0]) as a, FakeServer(echo[1]) as b:
        r2 = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=5))
    assert _srv(r2)["teacher_forcing"] == "echo"
    for key in ("kl", "top1_agreement", "nll_delta"):
        assert _cand(r1)[key] == pytest.approx(_cand(r2)[key], rel=1e-12)


@pytest.mark.parametrize("suffix", [".safetensors", ".json"])
def test_recorded_reference_matches_the_live_one(text: Path, tmp_path: Path, suffix: str) -> None:
    rec = tmp_path / f"ref{suffix}"
    with FakeServer(Behaviour(spec_k=3, per_request=True)) as b:
        own = run_server_validation(_cfg(b, text, record=rec))
    assert rec.is_file() and own["schemes"] == {} and own["reference"]["mean_acceptance_length"] is not None
    with FakeServer(Behaviour(noise=0.7)) as a, FakeServer(Behaviour(spec_k=3, per_request=True)) as b:
        live = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    with FakeServer(Behaviour(noise=0.7)) as a:
        later = run_server_validation(_cfg(a, text, against=rec))
    for key in ("kl", "top1_agreement", "nll_delta"):
        assert _cand(later)[key] == pytest.approx(_cand(live)[key], rel=1e-12)
    assert _cand(later)["decode"] == _cand(live)["decode"] and _cand(later)["decode"]["n"] > 0
    gen = _cand(later)["generation"]
    assert gen == {**_cand(live)["generation"], "seconds": gen["seconds"]}
    assert later["reference"]["mean_acceptance_length"] == live["reference"]["mean_acceptance_length"]


def test_acceptance_per_request_and_from_metrics_agree(text: Path) -> None:
    with FakeServer(Behaviour(spec_k=3, per_request=True)) as a:
        r1 = run_server_validation(_cfg(a, text))
    with FakeServer(Behaviour(spec_k=3)) as a:
        r2 = run_server_validation(_cfg(a, text))
    per_req, scraped = r1["reference"], r2["reference"]  # a server alone is its report's reference
    assert _srv(r1)["acceptance_source"] == "per_request" and _srv(r2)["acceptance_source"] == "metrics"
    assert r1["config"]["num_speculative_tokens"] == 3
    for key in ("num_drafts", "num_accepted_tokens", "num_accepted_tokens_per_pos", "mean_acceptance_length"):
        assert per_req[key] == scraped[key]
    # 12 tokens per prompt in steps accepting 2, 0, 1 drafts: 3 + 1 + 2 = 6 tokens per 3 steps -> 6 steps
    assert per_req["num_drafts"] == 3 * 6 and per_req["mean_acceptance_length"] == pytest.approx(2.0)
    assert per_req["num_accepted_tokens_per_pos"] == (3 * 4, 3 * 2, 0)


def test_acceptance_ratio_interval_needs_per_request_counts(text: Path) -> None:
    """Per-request metrics on both sides pair the prompts (equal servers: exactly 1.0); /metrics totals
    cannot, and the verdict falls back to the point estimate."""
    with (
        FakeServer(Behaviour(spec_k=3, per_request=True)) as a,
        FakeServer(Behaviour(spec_k=3, per_request=True)) as b,
    ):
        paired = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    assert _cand(paired)["acceptance_ratio_ci"] == pytest.approx([1.0, 1.0])
    with FakeServer(Behaviour(spec_k=3)) as a, FakeServer(Behaviour(spec_k=3)) as b:
        totals = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0)))
    assert _cand(totals)["acceptance_ratio_ci"] is None
    assert _cand(totals)["verdict"]["acceptance_ratio"] == pytest.approx(1.0)


def test_other_traffic_on_the_counters_is_a_warning(text: Path) -> None:
    with FakeServer(Behaviour(spec_k=2, extra_requests=1)) as a:
        r = run_server_validation(_cfg(a, text))
    assert any("other traffic" in w for w in _srv(r)["warnings"])


def test_no_logprobs_is_one_clear_error_and_generation_still_runs(text: Path) -> None:
    b = Behaviour(prompt_logprobs=False, echo_logprobs=False)
    with FakeServer(b) as a, FakeServer(Behaviour(prompt_logprobs=False, echo_logprobs=False)) as ref:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(ref, retries=0)))
    err = _srv(r)["errors"]["teacher_forced"]
    assert err.startswith("server does not return prompt logprobs: echo with logprobs")
    assert _cand(r)["generation"]["identical_generations"] == 3 and "kl" not in _cand(r)


def test_text_keyed_logprobs_are_refused_clearly(text: Path) -> None:
    b = Behaviour(prompt_logprobs=False, text_keys=True)
    with FakeServer(b) as a:
        r = run_server_validation(_cfg(a, text, record=None))
    assert "by token text" in _srv(r)["errors"]["teacher_forced"]


def test_dead_url(text: Path) -> None:
    with FakeServer() as url:
        pass  # closed: nothing listens there now
    with pytest.raises(ServerError, match=r"cannot connect to .*is the server running"):
        run_server_validation(_cfg(url, text))


def test_http_500(text: Path) -> None:
    with (
        FakeServer(Behaviour(fail_status=500)) as a,
        pytest.raises(ServerError, match="HTTP 500: simulated failure"),
    ):
        run_server_validation(_cfg(a, text))


def test_busy_server_is_retried_then_reported(text: Path) -> None:
    with (
        FakeServer(Behaviour(fail_status=503)) as a,
        pytest.raises(ServerError, match=r"HTTP 503.*after 3 attempts"),
    ):
        run_server_validation(_cfg(a, text, retries=2))


def test_timeout(text: Path) -> None:
    with (
        FakeServer(Behaviour(delay=1.0)) as a,
        pytest.raises(ServerError, match=r"no answer within 0.2 s \(--timeout\)"),
    ):
        run_server_validation(_cfg(a, text, timeout=0.2))


def test_logprobs_beyond_the_server_limit(text: Path) -> None:
    with (
        FakeServer(Behaviour(max_logprobs=5)) as a,
        FakeServer() as b,
        pytest.raises(ServerError, match="greater than max allowed: 5"),
    ):
        run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=10))


def test_no_tokenize_needs_a_local_tokenizer(text: Path) -> None:
    with (
        FakeServer(Behaviour(tokenize=False)) as a,
        pytest.raises(ServerError, match=r"has no /tokenize.*--tokenizer"),
    ):
        run_server_validation(_cfg(a, text))


def test_unknown_model_name(text: Path) -> None:
    with FakeServer() as a, pytest.raises(ServerError, match=r"'nope' is not served.*it serves: fake"):
        run_server_validation(_cfg(a, text, model="nope"))


def test_cli_json_and_report(text: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from mlaq.cli import main

    out = tmp_path / "out"
    with FakeServer(Behaviour(noise=0.3)) as a, FakeServer() as b:
        argv = ["validate", "--server", a, "--reference", b, "--eval-text", str(text), "--context-len", "48"]
        argv += [
            "--windows",
            "2",
            "--prompts",
            "2",
            "--prompt-len",
            "16",
            "--max-tokens",
            "8",
            "--buckets",
            "2",
        ]
        assert main([*argv, "--json", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == "server" and _srv(report, "reference")["url"] == b
    assert math.isfinite(_cand(report)["kl"])
    md = (out / "report.md").read_text()
    assert "Mean    KLD:" in md and "Same top p:" in md and "KL(reference ‖ scheme) by position" in md
    assert (out / "error_vs_position.png").is_file()


@pytest.mark.parametrize("flag", ["--windows", "--max-tokens"])
def test_one_run_shape_for_every_source(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The run-shape options are read once, into one RunShape: local and --server refuse alike."""
    from mlaq.cli import main

    for extra in ([], ["--server", "http://127.0.0.1:1"]):
        assert main(["validate", *extra, flag, "0", "--no-progress"]) == 2
        assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err, extra


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--reference", "http://127.0.0.1:1"], "--reference needs --server URL"),
        (["--server", "http://127.0.0.1:1", "--schemes", "mxfp4"], "--schemes is for local validation"),
        (["--server", "localhost:8000"], "must start with http://"),
        (["--server", "http://127.0.0.1:1", "--retries", "0"], "cannot connect to http://127.0.0.1:1"),
    ],
)
def test_cli_bad_combinations(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from mlaq.cli import main

    assert main(["validate", *extra, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_decode_path_compares_generated_tokens_while_contexts_agree(text: Path) -> None:
    with FakeServer(Behaviour(noise=0.5, max_logprobs=-1)) as a, FakeServer(Behaviour(max_logprobs=-1)) as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), logprobs=-1))
    c = _cand(r)
    d = c["decode"]
    firsts = c["generation"]["first_divergence"]
    # positions 1..f per prompt (all 11 when a generation never differs)
    assert d["n"] == sum(11 if f is None else f for f in firsts)
    assert d["kl_estimator"]["exact"] and d["kld"]["mean"] > 0


def test_task_suite_through_servers(text: Path) -> None:
    from mlaq.validate.tasks.spec import TaskConfig

    tasks = TaskConfig(tasks=("needle", "vartrack"), lengths=(256,), samples=3)
    with FakeServer(Behaviour(noise=0.5)) as a, FakeServer() as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), tasks=tasks))
    assert r["tasks"]["samples"] == 6
    table = _cand(r)["tasks"]
    assert set(table) == {"needle", "vartrack"}
    cell = table["needle"]["256"]
    assert cell["n"] == 3 and 0.0 <= cell["accuracy"] <= 1.0
    assert r["reference"]["tasks"]["needle"]["256"]["n"] == 3


def test_tasks_need_a_live_reference(tmp_path: Path, text: Path) -> None:
    from mlaq.validate.tasks.spec import TaskConfig

    with pytest.raises(ValueError, match="need a live reference"):
        _cfg("http://127.0.0.1:1", text, against=tmp_path / "x.json", tasks=TaskConfig())


@pytest.mark.parametrize("k", [-1, 3])
def test_monte_carlo_kl_is_unbiased_where_top_k_understates(text: Path, k: int) -> None:
    """--mc-kl: continuations sampled from the reference, scored on both: k1 and k3 cover the exact KL at
    the same positions (computed here from the toy model, an independent oracle); the top-k figure at
    those positions is exact only with whole distributions, else below it."""
    cand, ref = Behaviour(noise=1.5, max_logprobs=-1), Behaviour(max_logprobs=-1)
    with FakeServer(cand) as a, FakeServer(ref) as b:
        r = run_server_validation(
            _cfg(
                a, text, reference=ClientConfig(b, retries=0), logprobs=k, mc_kl=48, max_tokens=24, windows=1
            )
        )
    m = _cand(r)["mc_kl"]
    assert m["k1"]["sequences"] == 48 and m["k1"]["positions"] == 48 * 24
    exact = _sampled_exact(text, 48, 24, 1.5)
    if k == -1:
        assert m["topk_is_exact"] and m["topk_kl"] == pytest.approx(exact, rel=1e-9)
    else:
        assert not m["topk_is_exact"] and m["topk_kl"] < 0.9 * exact  # top-3 understates
    for name in ("k1", "k3"):
        low, high = m[name]["ci"]
        assert low <= exact <= high, (name, exact, m[name])


def _sampled_exact(text: Path, n: int, length: int, noise: float) -> float:
    """Independent oracle: replay the reference's sampling (prompt i mod P, seed i) on the toy model and
    average the exact KL(ref || cand) over every sampled position."""
    from mlaq.validate.text import load_eval_text

    class Tok:
        def encode(self, s: str, add_special_tokens: bool = False) -> list[int]:
            return [ord(ch) % VOCAB for ch in s]

    data = load_eval_text(text, Tok(), context_len=48, windows=1, prompts=3, prompt_len=16, seed=0)  # type: ignore[arg-type]
    prompts = data.prompts()
    kls = []
    for i in range(n):
        seq = list(prompts[i % len(prompts)])
        rng = np.random.default_rng(i)
        for _ in range(length):
            p, q = logprobs(seq, 0.0), logprobs(seq, noise)
            kls.append(float((np.exp(p) * (p - q)).sum()))
            seq.append(int(rng.choice(VOCAB, p=np.exp(p) / np.exp(p).sum())))
    return sum(kls) / len(kls)


def test_monte_carlo_kl_of_identical_servers_is_zero_and_needs_a_live_reference(
    text: Path, tmp_path: Path
) -> None:
    with FakeServer() as a, FakeServer() as b:
        r = run_server_validation(_cfg(a, text, reference=ClientConfig(b, retries=0), mc_kl=4, windows=1))
    m = _cand(r)["mc_kl"]
    assert m["k1"]["kl"] == 0 and m["k3"]["kl"] == 0
    assert m["k1"]["ci"] is None  # 4 continuations: below the minimum, the interval is n/a
    with pytest.raises(ValueError, match="--mc-kl samples continuations from the reference"):
        _cfg("http://127.0.0.1:9", text, mc_kl=4)
