"""--quantization-config: parsing, scheme resolution, and every error it can produce."""

import json
from pathlib import Path

import pytest

from mlaq.bmm import scheme_names
from mlaq.policy import decide, decide_from_dir, load_explicit, mla_model
from mlaq.policy.checkpoint import NoQuant
from mlaq.policy.explicit import match_model, resolve_scheme
from mlaq.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
SCHEMES = scheme_names()
ARCH = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
}
MODEL = mla_model({**ARCH, "q_lora_rank": 1536})


def load(obj) -> object:
    return load_explicit(obj if isinstance(obj, str) else json.dumps(obj), SCHEMES)


def test_scheme_names_cover_the_policy_vocabulary():
    for name in (
        "fp8_per_tensor",
        "fp8_per_block",
        "fp8_per_channel",
        "mxfp4",
        "mxfp4_w4a16",
        "mxfp8",
        "bf16",
    ):
        assert name in SCHEMES


@pytest.mark.parametrize(
    "value, scheme",
    [
        ("mxfp4", "mxfp4"),
        ("fp8_per_tensor_fnuz", "fp8_per_tensor_fnuz"),
        ({"weight": "mxfp4", "activation": "mxfp4"}, "mxfp4"),
        ({"weight": "mxfp4", "activation": "bf16"}, "mxfp4_w4a16"),
        ({"weight": "mxfp4", "activation": "none"}, "mxfp4_w4a16"),
        ({"weight": "mxfp4", "activation": None}, "mxfp4_w4a16"),
        ({"weight": "mxfp4"}, "mxfp4_w4a16"),
        ({"weight": "mxfp8", "activation": "MXFP8"}, "mxfp8"),
        ({"weight": "fp8_per_block", "activation": "fp8"}, "fp8_per_block"),
        ({"weight": "fp8_per_head", "activation": "fp8"}, "fp8_per_head"),
        ({"weight": "bf16", "activation": "bf16"}, "bf16"),
    ],
)
def test_resolve_scheme(value, scheme):
    assert resolve_scheme(value, "t", SCHEMES) == scheme


@pytest.mark.parametrize(
    "value, message",
    [
        ("fp4", "t: unknown scheme 'fp4'; known schemes: fp32, bf16"),
        ({"weight": "nvfp4", "activation": "bf16"}, "unknown weight scheme 'nvfp4'"),
        (
            {"weight": "mxfp4", "activation": "fp8"},
            "no mlaq scheme implements weight mxfp4 with activation fp8",
        ),
        (
            {"weight": "fp8_per_tensor", "activation": "bf16"},
            "no mlaq scheme implements weight fp8_per_tensor",
        ),
        ({"weight": "mxfp8", "activation": "mxfp4"}, "no mlaq scheme implements"),
        ({"weight": "mxfp4", "activation": "int8"}, "unknown activation 'int8'"),
        ({"weight": "mxfp4", "act": "bf16"}, "expected a scheme name or"),
        ({"activation": "bf16"}, "expected a scheme name or"),
        (4, "expected a scheme name or"),
    ],
)
def test_resolve_scheme_errors(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_scheme(value, "t", SCHEMES)


def test_inline_and_file(tmp_path):
    cfg = {"targets": {"re:.*kv_b_proj": {"weight": "mxfp4", "activation": "bf16"}}, "ignore": ["lm_head"]}
    inline = load(cfg)
    f = tmp_path / "q.json"
    f.write_text(json.dumps(cfg))
    from_file = load_explicit(f"@{f}", SCHEMES)
    assert inline == from_file
    assert inline.targets[0].scheme == "mxfp4_w4a16" and inline.to_json() == cfg


@pytest.mark.parametrize(
    "text, message",
    [
        ("{targets", "--quantization-config: not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"target": {}}', r"unknown keys \['target'\]"),
        ('{"targets": ["re:.*"]}', "targets must be a dict, got list"),
        ('{"ignore": "lm_head"}', "ignore must be a list"),
        ('{"targets": {"re:(": "mxfp4"}}', "is not a valid regular expression"),
        ("@/nonexistent/q.json", "no such file"),
    ],
)
def test_parse_errors(text, message):
    with pytest.raises(ValueError, match=message):
        load_explicit(text, SCHEMES)


# --- checked against a model ---------------------------------------------------------------------


def test_targets_matching_no_kv_b_proj_is_an_error():
    with pytest.raises(
        ValueError, match=r"targets pattern 're:.*kv_c_proj' matches no layer but no kv_b_proj"
    ):
        match_model(load({"targets": {"re:.*kv_c_proj": "mxfp4"}}), MODEL)
    # vLLM matches a layer's own name: a parent module's name targets nothing there, so nothing here
    with pytest.raises(ValueError, match="not a module above it"):
        match_model(load({"targets": {"model.layers.3.self_attn": "mxfp4"}}), MODEL)


def test_ignore_may_name_any_layer_as_in_vllm():
    for ignore in (["lm_head"], ["model.layers.9.self_attn"], ["model.layers.3.self_attn"]):
        assert all(x.ignore is None for x in match_model(load({"ignore": ignore}), MODEL))


def test_targets_on_other_attention_linears_is_an_error():
    with pytest.raises(ValueError) as exc:
        match_model(load({"targets": {"re:.*q_b_proj": "mxfp4"}}), MODEL)
    msg = str(exc.value)
    assert "matches model.layers.0.self_attn.q_b_proj, model.layers.1.self_attn.q_b_proj" in msg
    assert "but no kv_b_proj" in msg
    # a pattern over kv_b_proj AND other linears: vLLM would quantize them all; mlaq cannot
    with pytest.raises(ValueError, match=r"also matches model\.layers\.0\.self_attn\.q_a_proj"):
        match_model(load({"targets": {"re:.*self_attn.*": "fp8_per_tensor"}}), MODEL)


def test_q_proj_exists_only_without_q_lora():
    no_lora = mla_model({**ARCH, "q_lora_rank": None})
    with pytest.raises(ValueError, match=r"matches model\.layers\.0\.self_attn\.q_proj"):
        match_model(load({"targets": {"re:.*\\.q_proj$": "mxfp4"}}), no_lora)
    with pytest.raises(ValueError, match="matches no layer"):
        match_model(load({"targets": {"re:.*\\.q_proj$": "mxfp4"}}), MODEL)


def test_more_than_one_target_is_an_error():
    cfg = {"targets": {"re:.*kv_b_proj": "mxfp4", "model.layers.2.self_attn.kv_b_proj": "fp8_per_tensor"}}
    with pytest.raises(ValueError) as exc:
        match_model(load(cfg), MODEL)
    assert str(exc.value) == (  # vLLM's words (online/base.py)
        "--quantization-config: Layer model.layers.2.self_attn.kv_b_proj matches multiple "
        "quantization_config.targets patterns: ['re:.*kv_b_proj', 'model.layers.2.self_attn.kv_b_proj']. "
        "Each layer may match at most one target."
    )


def test_ignore_and_targets_on_one_layer_is_an_error():
    cfg = {"targets": {"*kv_b_proj": "mxfp4"}, "ignore": ["re:model.layers.[34].*"]}
    with pytest.raises(ValueError) as exc:
        match_model(load(cfg), MODEL)
    assert str(exc.value) == (
        "--quantization-config: Layer model.layers.3.self_attn.kv_b_proj matches both quantization_config.ignore "
        "and quantization_config.targets (['*kv_b_proj']); a layer may not be referenced by both."
    )


def test_ignore_may_name_other_attention_modules():
    m = match_model(load({"ignore": ["re:.*o_proj"]}), MODEL)  # harmless: kv_b_proj is not covered
    assert all(x.ignore is None for x in m)


def test_match_per_layer():
    m = match_model(
        load(
            {
                "targets": {"model.layers.1.self_attn.kv_b_proj": "mxfp4"},
                "ignore": ["model.layers.4.self_attn.kv_b_proj"],
            }
        ),
        MODEL,
    )
    assert [x.target is not None for x in m] == [False, True, False, False, False]
    assert [x.ignore is not None for x in m] == [False, False, False, False, True]


def test_unknown_method_needs_targets_for_every_layer(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({**ARCH, "q_lora_rank": 1536, "quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(ValueError) as exc:
        decide_from_dir(tmp_path, Settings(), log=False)
    assert "quant_method 'gptq' is not one mlaq reads" in str(exc.value)
    assert "kv_b_proj of layers 0-4 is unknown" in str(exc.value)
    partial = '{"targets": {"re:model.layers.[0-2].self_attn.kv_b_proj": "bf16"}}'
    with pytest.raises(ValueError, match="kv_b_proj of layers 3-4 is unknown"):
        decide_from_dir(tmp_path, Settings(), partial, log=False)
    r = decide_from_dir(tmp_path, Settings(), '{"targets": {"*kv_b_proj": "bf16"}}', log=False)
    assert {(d.source, d.scheme, d.rule.value) for d in r.layers} == {("unknown", "bf16", "targets")}


def test_decide_rejects_unregistered_target_scheme_via_loader():
    with pytest.raises(ValueError, match="fp8_per_row is not a valid online shorthand name"):
        decide_from_dir(FIXTURES / "zai-org--GLM-4.7-Flash", Settings(), '{"targets": {"*": "fp8_per_row"}}')


def test_decide_with_explicit_object():
    r = decide(
        MODEL, NoQuant(), Settings(fp4bmm=True), load({"ignore": ["model.layers.0.self_attn.kv_b_proj"]})
    )
    assert [d.rule.value for d in r.layers] == ["ignore", "flag", "flag", "flag", "flag"]
    assert r.for_layer(0).pattern == "model.layers.0.self_attn.kv_b_proj"
    assert r.settings_json()["quantization_config"] == {
        "targets": {},
        "ignore": ["model.layers.0.self_attn.kv_b_proj"],
    }
