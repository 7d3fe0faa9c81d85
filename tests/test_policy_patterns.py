"""Module-name patterns: exact / re: (re.match, start-anchored) / glob (whole name), parents cover children."""

import pytest

from mlaq.policy.patterns import Pattern, PatternKind, ancestors, covering, first_covering, parse_patterns

KV = "model.layers.3.self_attn.kv_b_proj"


def p(text: str) -> Pattern:
    return Pattern.parse(text, "test")


def test_kinds():
    assert p("lm_head").kind is PatternKind.EXACT
    assert p("re:.*kv_b_proj").kind is PatternKind.REGEX
    assert p("*self_attn*").kind is PatternKind.GLOB
    assert p("model.layers.[0-9].mlp").kind is PatternKind.GLOB


def test_ancestors():
    assert ancestors("a.b.c") == ("a", "a.b", "a.b.c")


@pytest.mark.parametrize(
    "pattern, hit",
    [
        (KV, True),
        ("model.layers.3.self_attn", True),  # parent module covers kv_b_proj
        ("model.layers.3", True),
        ("model.layers.30.self_attn", False),
        ("model.layers.3.self_attn.kv_b", False),  # exact names are not prefixes
        ("kv_b_proj", False),  # exact = whole name
        ("re:.*self_attn.*", True),
        ("re:.*kv_b_proj", True),
        ("re:kv_b_proj", False),  # re.match anchors at the start, like vLLM / compressed-tensors
        ("re:model.layers.3.*", True),
        ("re:model\\.layers\\.3\\.self_attn$", True),  # matches the parent exactly -> covers the child
        ("re:.*q_a_proj", False),
        ("re:model.layers.61.*", False),
        ("*self_attn*", True),
        ("*kv_b_proj", True),
        ("model.layers.3.self_attn*", True),  # ModelOpt style
        ("model.layers.*.self_attn", True),  # glob on the parent
        ("*kv_b", False),  # glob = whole name
        ("*KV_B_PROJ", False),  # case-sensitive
    ],
)
def test_covers(pattern, hit):
    assert p(pattern).covers(KV) is hit


def test_matches_is_single_name():
    assert not p("model.layers.3.self_attn").matches(KV)
    assert p("model.layers.3.self_attn").covers(KV)


def test_regex_start_anchor_matches_prefix_layers_too():
    # documented hazard of re.match semantics: "layers.1" also starts "layers.10"
    assert p("re:model.layers.1").covers("model.layers.10.self_attn.kv_b_proj")
    assert not p("re:model.layers.1$").covers("model.layers.10.self_attn.kv_b_proj")


def test_bad_regex_is_an_error():
    with pytest.raises(ValueError, match=r"cfg: 're:\(' is not a valid regular expression"):
        Pattern.parse("re:(", "cfg")


@pytest.mark.parametrize("bad", ["", "  ", None, 3, ["x"]])
def test_bad_pattern_types(bad):
    with pytest.raises(ValueError, match="non-empty string"):
        Pattern.parse(bad, "cfg")


def test_parse_patterns():
    assert parse_patterns(None, "x") == ()
    assert [q.text for q in parse_patterns(["a", "re:b"], "x")] == ["a", "re:b"]
    with pytest.raises(ValueError, match="x must be a list"):
        parse_patterns("lm_head", "x")


def test_covering_order():
    pats = parse_patterns(["lm_head", "re:.*self_attn.*", "*kv_b_proj"], "x")
    assert [q.text for q in covering(pats, KV)] == ["re:.*self_attn.*", "*kv_b_proj"]
    assert first_covering(pats, KV).text == "re:.*self_attn.*"
    assert first_covering(pats, "model.layers.0.mlp.gate") is None
