"""``mlaq explain``: the folded table, exactly one JSON object with --json, errors on stderr."""

import json
from pathlib import Path

import pytest

from mlaq.cli import main

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
GLM52 = str(FIXTURES / "constructed--GLM-5.2-MXFP4")
R1 = str(FIXTURES / "constructed--DeepSeek-R1-0528-MXFP4")


@pytest.fixture
def env(monkeypatch):
    monkeypatch.delenv("MLAQ_FP8BMM", raising=False)
    monkeypatch.delenv("MLAQ_FP4BMM", raising=False)
    return monkeypatch


def explain(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["explain", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_lists_explain(capsys):
    assert main([]) == 0
    assert "explain" in capsys.readouterr().out


def test_table_folds_ranges_and_shows_settings(env, capsys):
    env.setenv("MLAQ_FP4BMM", "1")
    env.setenv("MLAQ_FP8BMM", "1")
    rc, out, err = explain(capsys, GLM52)
    assert rc == 0 and err == ""
    lines = out.splitlines()
    assert "model_type glm_moe_dsa" in lines[0]
    assert lines[1].startswith(
        "MLA layers:  79 (78 decoder + 1 MTP); module model.layers.{i}.self_attn.kv_b_proj"
    )
    assert lines[3] == "settings:    MLAQ_FP8BMM=1 MLAQ_FP4BMM=1"
    assert lines[4] == "quantization-config: none"
    rows = [ln for ln in lines if ln[:1].isdigit()]
    assert len(rows) == 2
    assert rows[0].split()[:4] == ["0-77", "bf16", "bf16", "guard"]
    assert rows[1].split()[:5] == ["78", "(MTP)", "bf16", "bf16", "guard"]
    assert "exclude lists 'model.layers.{i}.self_attn.kv_b_proj'" in rows[0]
    assert "exclude lists 'model.layers.78.self_attn.kv_b_proj'" in rows[1]
    assert lines[-1] == "kv_b_proj re-quantized in none of 79 MLA layers: 79 bf16 (rule guard)."


def test_table_with_targets(env, capsys):
    rc, out, _ = explain(
        capsys, GLM52, "--quantization-config", '{"targets": {"model.layers.3.self_attn.kv_b_proj": "mxfp4"}}'
    )
    assert rc == 0
    rows = [ln.split()[:4] for ln in out.splitlines() if ln[:1].isdigit()]
    assert rows == [
        ["0-2", "bf16", "bf16", "default"],
        ["3", "bf16", "mxfp4", "targets"],
        ["4-77", "bf16", "bf16", "default"],
        ["78", "(MTP)", "bf16", "bf16"],
    ]
    assert (
        'quantization-config: {"targets": {"model.layers.3.self_attn.kv_b_proj": "mxfp4"}, "ignore": []}'
        in out
    )
    assert (
        "Re-quantizing kv_b_proj in 1 of 79 MLA layers to mxfp4 (from targets: model.layers.3.self_attn.kv_b_proj)"
        in out
    )


def test_json_is_exactly_one_object(env, capsys):
    env.setenv("MLAQ_FP4BMM", "on")
    rc, out, err = explain(capsys, R1, "--json")
    assert rc == 0 and err == ""
    obj = json.loads(out)  # raises if there is anything besides one JSON document
    assert list(obj) == ["model_type", "settings", "layers", "weights_checked"]
    assert obj["weights_checked"] is None  # config files only unless --check-weights
    assert obj["model_type"] == "deepseek_v3"
    assert obj["settings"] == {"MLAQ_FP8BMM": False, "MLAQ_FP4BMM": True, "quantization_config": None}
    assert len(obj["layers"]) == 62
    assert obj["layers"][0] == {
        "layer": 0,
        "module": "model.layers.0.self_attn.kv_b_proj",
        "source": "bf16",
        "scheme": "mxfp4",
        "rule": "family-opt-in",
        "reason": obj["layers"][0]["reason"],
    }
    assert obj["layers"][61]["layer"] == 61 and obj["layers"][61]["rule"] == "checkpoint"
    assert all(set(x) == {"layer", "module", "source", "scheme", "rule", "reason"} for x in obj["layers"])


def test_quantization_config_from_file(env, capsys, tmp_path):
    f = tmp_path / "q.json"
    f.write_text('{"targets": {"re:.*kv_b_proj": {"weight": "mxfp4", "activation": "bf16"}}}')
    rc, out, _ = explain(capsys, GLM52, "--json", "--quantization-config", f"@{f}")
    obj = json.loads(out)
    assert rc == 0 and {x["scheme"] for x in obj["layers"]} == {"mxfp4_w4a16"}
    assert obj["settings"]["quantization_config"]["targets"] == {
        "re:.*kv_b_proj": {"weight": "mxfp4", "activation": "bf16"}
    }


@pytest.mark.parametrize(
    "args, env_vars, message",
    [
        ([GLM52], {"MLAQ_FP4BMM": "maybe"}, "MLAQ_FP4BMM='maybe' is not a boolean"),
        (["/nonexistent/model"], {}, "not a local directory; mlaq does not download"),
        (
            [GLM52, "--quantization-config", '{"targets": {"re:.*kv_b_proj": "fp4"}}'],
            {},
            "fp4 is not a valid online shorthand name",
        ),
        (
            [str(FIXTURES / "constructed--DeepSeek-V3-NVFP4-attn")],
            {},
            "no mlaq BMM scheme runs that format exactly",
        ),
    ],
)
def test_errors_exit_nonzero_with_message_on_stderr(env, capsys, args, env_vars, message):
    for k, v in env_vars.items():
        env.setenv(k, v)
    rc, out, err = explain(capsys, *args)
    assert rc != 0 and out == ""
    assert err.startswith("mlaq explain: error: ") and message in err


def test_subprocess_json_and_error(mlaq_cli):
    ok = mlaq_cli("explain", str(FIXTURES / "deepseek-ai--DeepSeek-V3"), "--json", env={"MLAQ_FP8BMM": "1"})
    assert ok.returncode == 0, ok.stderr
    obj = json.loads(ok.stdout)
    assert {(x["scheme"], x["rule"]) for x in obj["layers"]} == {("fp8_per_block", "checkpoint")}
    bad = mlaq_cli("explain", GLM52, env={"MLAQ_FP8BMM": "enable"})
    assert bad.returncode == 2 and bad.stdout == ""
    assert (
        "MLAQ_FP8BMM='enable' is not a boolean; accepted values: 1/0, true/false, yes/no, on/off"
        in bad.stderr
    )


@pytest.mark.parametrize("index", ["[1, 2]", '{"weight_map": ["a"]}'])
def test_malformed_safetensors_index_is_a_clear_error(env, capsys, tmp_path, index):
    (tmp_path / "config.json").write_text((Path(GLM52) / "config.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(index)
    rc, out, err = explain(capsys, str(tmp_path))
    assert rc != 0 and out == ""
    assert "model.safetensors.index.json: expected a JSON object with a 'weight_map'" in err
