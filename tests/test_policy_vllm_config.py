"""``--quantization-config`` read as vLLM 0.32 reads it (vllm/config/quantization.py, online/base.py):
keys, values, exclusivity, file forms, duplicate keys, and the "Quantizing N layers" line."""

from __future__ import annotations

import json

import pytest

from mlaq.bmm import scheme_names
from mlaq.policy import load_explicit, mla_model
from mlaq.policy.explicit import match_model
from mlaq.policy.vllm_online import layer_type, quantizing_line

SCHEMES = scheme_names()
ARCH = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "kv_lora_rank": 64,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
}


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"targets": {"re:.*kv_b_proj": "mxfp4"}, "targets": {}}', "duplicate key 'targets'"),
        ('{"targets": {"a": "mxfp4", "a": "bf16"}}', "duplicate key 'a'"),
        ('{"linear": "fp8_per_tensor"}', "'linear' quantizes every linear layer"),
        ('{"moe": "mxfp4"}', "'moe' quantizes the routed experts"),
        (
            '{"targets": {"re:.*kv_b_proj": "mxfp4"}, "linear": "fp8_per_tensor"}',
            "quantization_config.targets is mutually exclusive with quantization_config.linear/moe",
        ),
        ('{"targets": {"re:.*kv_b_proj": "nvfp4_per_token"}}', "does not define a QuantSpec for LinearBase"),
        ('{"targets": {"re:.*kv_b_proj": "int8_per_channel_weight_only"}}', "does not define a QuantSpec"),
        (
            '{"targets": {"re:.*kv_b_proj": "fp8"}}',
            "fp8 is not a valid online shorthand name; expected one of",
        ),
        ('{"quant_method": "fp8"}', r"unknown keys \['quant_method'\]; vLLM's quantization_config keys"),
    ],
)
def test_vllm_schema_errors(text, message):
    with pytest.raises(ValueError, match=message):
        load_explicit(text, SCHEMES)


def test_file_forms(tmp_path):
    f = tmp_path / "q.json"
    f.write_text('{"targets": {"re:.*kv_b_proj": "fp8_per_channel"}}')
    for value in (f"@{f}", str(f)):
        cfg = load_explicit(value, SCHEMES)
        assert [(t.pattern.text, t.scheme) for t in cfg.targets] == [("re:.*kv_b_proj", "fp8_per_channel")]
    with pytest.raises(ValueError, match="is a directory; pass a JSON file"):
        load_explicit(f"@{tmp_path}", SCHEMES)
    with pytest.raises(ValueError, match="is a directory"):
        load_explicit(str(tmp_path), SCHEMES)
    with pytest.raises(ValueError, match="no such file"):
        load_explicit(str(tmp_path / "missing.json"), SCHEMES)
    dup = tmp_path / "dup.json"
    dup.write_text('{"ignore": [], "ignore": ["lm_head"]}')
    with pytest.raises(ValueError, match=f"--quantization-config @{dup}: duplicate key 'ignore'"):
        load_explicit(f"@{dup}", SCHEMES)


@pytest.mark.parametrize(
    "pattern, layers",
    [
        ("re:.*kv_b_proj", [0, 1, 2]),  # re.match from the start
        ("re:model.layers.1.self_attn.kv_b", [1]),  # re.match is not anchored at the end
        ("model.layers.2.self_attn.kv_b_proj", [2]),  # exact
        ("model.layers.[01].self_attn.kv_b_proj", [0, 1]),  # fnmatch
        ("*kv_b_proj", [0, 1, 2]),
    ],
)
def test_vllm_matching_rules(pattern, layers):
    m = match_model(load_explicit(json.dumps({"targets": {pattern: "mxfp4"}}), SCHEMES), mla_model(ARCH))
    assert [i for i, x in enumerate(m) if x.target is not None] == layers


def test_quantizing_line_is_vllms():
    assert layer_type("model.layers.3.self_attn.kv_b_proj") == "self_attn.kv_b_proj"
    names = [f"model.layers.{i}.self_attn.kv_b_proj" for i in range(3)]
    line = quantizing_line((n, "targets", "re:.*kv_b_proj", "mxfp4") for n in names)
    assert (
        line == "Quantizing 3 layers of types: self_attn.kv_b_proj: 3 (from targets: re:.*kv_b_proj, mxfp4)"
    )
