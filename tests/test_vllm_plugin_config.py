"""The vLLM plugin's setting: off without one, every key checked, one message naming the key."""

import pytest

from mlaq.integrations.vllm.config import Mode, Precision, read_config
from mlaq.settings import VllmPluginEnv

EMULATE = {"mode": "emulate", "targets": {"re:.*kv_b_proj": "mxfp4"}}


def test_no_setting_is_off():
    assert read_config(None, None) is None
    assert read_config({}, None) is None
    assert read_config({"other_plugin": {"x": 1}}, None) is None


def test_additional_config_wins_over_the_environment():
    cfg = read_config({"mlaq": {"mode": "policy"}}, '{"mode": "emulate"}')
    assert cfg is not None and cfg.mode is Mode.POLICY and cfg.where == "--additional-config mlaq"


def test_environment_json():
    cfg = read_config(
        None,
        '{"mode": "emulate", "targets": {"re:.*kv_b_proj": "fp8_per_tensor"}, "precision": "consistent"}',
    )
    assert cfg is not None and cfg.mode is Mode.EMULATE and cfg.precision is Precision.CONSISTENT
    assert cfg.explicit is not None and cfg.explicit.targets[0].scheme == "fp8_per_tensor"


def test_precision_absorbed():
    cfg = read_config({"mlaq": EMULATE | {"precision": "absorbed"}}, None)
    assert cfg is not None and cfg.precision is Precision.ABSORBED
    assert "precision absorbed" in cfg.describe()


@pytest.mark.parametrize(
    ("obj", "words"),
    [
        ({"mode": "fast"}, ["--additional-config mlaq.mode", "'fast'", "policy", "emulate"]),
        ({}, ["mlaq.mode: missing"]),
        ({"mode": "policy", "taregts": {}}, ["unknown key 'taregts'", "targets"]),
        ({"mode": "emulate"}, ["mode emulate needs targets"]),
        ({"mode": "policy", "precision": "consistent"}, ["mlaq.precision", "only mode emulate"]),
        ({"mode": "policy", "precision": "absorbed"}, ["mlaq.precision: absorbed", "only mode emulate"]),
        (
            {"mode": "emulate", "precision": "full", "targets": {"re:.*kv_b_proj": "mxfp4"}},
            ["mlaq.precision: 'full'"],
        ),
        ({"mode": "emulate", "targets": {"re:.*kv_b_proj": "fp5"}}, ["targets", "fp5", "mxfp4"]),
        ("policy", ["expected a JSON object"]),
    ],
)
def test_bad_settings_name_the_key(obj, words):
    with pytest.raises(ValueError) as e:
        read_config({"mlaq": obj}, None)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert "\n" not in str(e.value)


def test_bad_environment_json():
    with pytest.raises(ValueError, match="MLAQ_VLLM_PLUGIN: not valid JSON"):
        read_config(None, "{mode: policy}")


def test_plugin_env_reads_the_flags_as_the_user_set_them():
    assert VllmPluginEnv.from_env({}) == VllmPluginEnv(None, None, None)
    env = VllmPluginEnv.from_env(
        {
            "MLAQ_VLLM_PLUGIN": '{"mode": "policy"}',
            "VLLM_ROCM_USE_AITER_FP8BMM": "0",
            "VLLM_ROCM_USE_AITER_FP4BMM": "True",
        }
    )
    assert env == VllmPluginEnv('{"mode": "policy"}', False, True)
    assert VllmPluginEnv.from_env({"MLAQ_VLLM_PLUGIN": "  "}).config is None
    with pytest.raises(ValueError, match="VLLM_ROCM_USE_AITER_FP4BMM='yes'"):
        VllmPluginEnv.from_env({"VLLM_ROCM_USE_AITER_FP4BMM": "yes"})
