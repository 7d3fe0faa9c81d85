"""Decision tables for the real and constructed checkpoint configs under every flag combination."""

import logging
from pathlib import Path

import pytest

from mlaq.policy import Rule, decide_from_dir
from mlaq.policy.report import fold
from mlaq.settings import Settings

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
OFF, FP8, FP4, BOTH = Settings(), Settings(fp8bmm=True), Settings(fp4bmm=True), Settings(True, True)


def table(name: str, settings: Settings, qc: str | None = None) -> list[tuple]:
    result = decide_from_dir(FIXTURES / name, settings, qc, log=False)
    return [(r.first, r.last, r.source, r.scheme, r.rule) for r in fold(result.layers)]


def uniform(n: int, source: str, scheme: str, rule: str, mtp: int = 1) -> list[tuple]:
    """Decoder layers 0..n-1 and the MTP layer(s), all with the same decision."""
    return [(0, n - 1, source, scheme, rule), (n, n + mtp - 1, source, scheme, rule)]


# --- real fixtures -------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [OFF, FP8, FP4, BOTH])
def test_deepseek_v3_fp8_keeps_block_fp8(settings):
    # The key regression: the FP8 flag must NOT turn block FP8 into fp8_per_tensor (vLLM does).
    assert table("deepseek-ai--DeepSeek-V3", settings) == uniform(
        61, "fp8_per_block", "fp8_per_block", "checkpoint"
    )


@pytest.mark.parametrize("settings", [OFF, FP8, FP4, BOTH])
def test_glm51_fp8_keeps_block_fp8(settings):
    assert table("zai-org--GLM-5.1-FP8", settings) == uniform(
        78, "fp8_per_block", "fp8_per_block", "checkpoint"
    )


@pytest.mark.parametrize(
    "settings, scheme, rule",
    [
        (OFF, "bf16", "default"),
        (FP8, "fp8_per_tensor", "flag"),
        (FP4, "mxfp4", "flag"),
        (BOTH, "mxfp4", "flag"),
    ],
)
def test_glm47_flash_bf16_no_config_follows_flags(settings, scheme, rule):
    assert table("zai-org--GLM-4.7-Flash", settings) == uniform(47, "bf16", scheme, rule)


@pytest.mark.parametrize(
    "settings, rule", [(OFF, "default"), (FP8, "guard"), (FP4, "guard"), (BOTH, "guard")]
)
def test_modelopt_nvfp4_excluded_attention_is_guarded(settings, rule):
    assert table("nvidia--DeepSeek-V3-0324-NVFP4", settings) == uniform(61, "bf16", "bf16", rule)


@pytest.mark.parametrize(
    "settings, scheme, rule",
    [
        (OFF, "bf16", "default"),
        (FP8, "fp8_per_tensor", "family-opt-in"),  # the opt-in lifts the guard, as in the engine
        (FP4, "mxfp4", "family-opt-in"),
        (BOTH, "mxfp4", "family-opt-in"),
    ],
)
def test_quark_deepseek_v32_family_opt_in(settings, scheme, rule):
    assert table("quark-mxfp4--DeepSeek-V3.2", settings) == uniform(61, "bf16", scheme, rule)


def test_explicit_targets_on_real_fixtures():
    qc = '{"targets": {"re:.*kv_b_proj": "mxfp4"}}'
    assert table("deepseek-ai--DeepSeek-V3", OFF, qc) == uniform(61, "fp8_per_block", "mxfp4", "targets")
    assert table("zai-org--GLM-4.7-Flash", BOTH, '{"targets": {"*kv_b_proj": "fp8_per_block"}}') == uniform(
        47, "bf16", "fp8_per_block", "targets"
    )
    assert table("nvidia--DeepSeek-V3-0324-NVFP4", BOTH, qc) == uniform(61, "bf16", "mxfp4", "targets")


def test_explicit_ignore_exempts_from_flags():
    qc = '{"ignore": ["model.layers.5.self_attn.kv_b_proj"]}'
    assert table("zai-org--GLM-4.7-Flash", FP4, qc) == [
        (0, 4, "bf16", "mxfp4", "flag"),
        (5, 5, "bf16", "bf16", "ignore"),
        (6, 46, "bf16", "mxfp4", "flag"),
        (47, 47, "bf16", "mxfp4", "flag"),
    ]
    # ignore on a quantized checkpoint keeps its own format
    assert table("deepseek-ai--DeepSeek-V3", BOTH, '{"ignore": ["re:.*"]}') == uniform(
        61, "fp8_per_block", "fp8_per_block", "ignore"
    )


def test_targeting_the_stored_format_uses_checkpoint_data():
    r = decide_from_dir(
        FIXTURES / "deepseek-ai--DeepSeek-V3",
        OFF,
        '{"targets": {"re:.*kv_b_proj": "fp8_per_block"}}',
        log=False,
    )
    d = r.for_layer(0)
    assert d.rule is Rule.TARGETS and d.uses_checkpoint_data and not d.requantized
    d = decide_from_dir(FIXTURES / "deepseek-ai--DeepSeek-V3", OFF, log=False).for_layer(61)
    assert d.uses_checkpoint_data and d.stored.block_size == (128, 128) and d.mtp


# --- constructed fixtures ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, scheme, rule",
    [
        (OFF, "bf16", "default"),
        (FP8, "fp8_per_tensor", "flag"),
        (FP4, "mxfp4", "flag"),
        (BOTH, "mxfp4", "flag"),
    ],
)
def test_bf16_without_quant_config_flags_requantize(settings, scheme, rule):
    assert table("constructed--DeepSeek-V3-bf16", settings) == uniform(61, "bf16", scheme, rule)


@pytest.mark.parametrize(
    "settings, rule", [(OFF, "default"), (FP8, "guard"), (FP4, "guard"), (BOTH, "guard")]
)
def test_glm52_mxfp4_guard_keeps_bf16_in_all_79_layers(settings, rule):
    # THE regression of the seed: GLM-5.2-MXFP4 excludes kv_b_proj; re-quantizing it broke MTP acceptance.
    result = decide_from_dir(FIXTURES / "constructed--GLM-5.2-MXFP4", settings, log=False)
    assert len(result.layers) == 79
    assert all(d.scheme == "bf16" and d.rule.value == rule for d in result.layers)
    assert result.for_layer(78).mtp and result.for_layer(78).module == "model.layers.78.self_attn.kv_b_proj"
    assert not any(d.requantized for d in result.layers)


def test_glm52_mxfp4_explicit_targets_still_win():
    qc = '{"targets": {"re:.*kv_b_proj": "mxfp4"}}'
    assert table("constructed--GLM-5.2-MXFP4", BOTH, qc) == uniform(78, "bf16", "mxfp4", "targets")
    qc = '{"targets": {"model.layers.3.self_attn.kv_b_proj": "mxfp4_w4a16"}}'
    assert table("constructed--GLM-5.2-MXFP4", BOTH, qc) == [
        (0, 2, "bf16", "bf16", "guard"),
        (3, 3, "bf16", "mxfp4_w4a16", "targets"),
        (4, 77, "bf16", "bf16", "guard"),
        (78, 78, "bf16", "bf16", "guard"),
    ]


@pytest.mark.parametrize(
    "settings, scheme, rule",
    [(OFF, "bf16", "default"), (FP8, "fp8_per_tensor", "family-opt-in"), (FP4, "mxfp4", "family-opt-in")],
)
def test_deepseek_r1_mxfp4_family_opt_in(settings, scheme, rule):
    assert table("constructed--DeepSeek-R1-0528-MXFP4", settings) == [
        (0, 60, "bf16", scheme, rule),
        (61, 61, "mxfp4", "mxfp4", "checkpoint"),  # the MTP layer is stored MXFP4: kept as stored
    ]


@pytest.mark.parametrize(
    "settings, rule", [(OFF, "default"), (FP8, "guard"), (FP4, "guard"), (BOTH, "guard")]
)
def test_compressed_tensors_ignoring_self_attn_is_guarded(settings, rule):
    assert table("constructed--DeepSeek-V3-FP8-dynamic-ct", settings) == uniform(61, "bf16", "bf16", rule)


@pytest.mark.parametrize("settings", [OFF, BOTH])
def test_nvfp4_stored_kv_b_is_an_error_without_targets(settings):
    with pytest.raises(ValueError) as exc:
        decide_from_dir(FIXTURES / "constructed--DeepSeek-V3-NVFP4-attn", settings, log=False)
    msg = str(exc.value)
    assert "kv_b_proj of layers 0-60 as nvfp4" in msg and "no mlaq BMM scheme runs that format exactly" in msg
    assert "--quantization-config" in msg


def test_nvfp4_stored_kv_b_with_targets():
    qc = '{"targets": {"re:.*kv_b_proj": "bf16"}}'
    assert table("constructed--DeepSeek-V3-NVFP4-attn", FP4, qc) == [
        (0, 60, "nvfp4", "bf16", "targets"),  # dequantized, runs in bf16
        (61, 61, "bf16", "bf16", "targets"),
    ]
    # targets covering only the NVFP4 layers; the excluded MTP layer follows the guard
    qc = '{"targets": {"re:model\\\\.layers\\\\.([0-9]|[1-5][0-9]|60)\\\\.self_attn\\\\.kv_b_proj": "fp8_per_tensor"}}'
    assert table("constructed--DeepSeek-V3-NVFP4-attn", FP4, qc) == [
        (0, 60, "nvfp4", "fp8_per_tensor", "targets"),
        (61, 61, "bf16", "bf16", "guard"),
    ]


# --- logging -------------------------------------------------------------------------------------


def test_one_warning_when_requantizing(caplog):
    caplog.set_level(logging.INFO, logger="mlaq.policy")
    decide_from_dir(FIXTURES / "constructed--DeepSeek-R1-0528-MXFP4", FP4)
    records = [r for r in caplog.records if r.name == "mlaq.policy"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert (
        records[0]
        .getMessage()
        .startswith(
            "Re-quantizing kv_b_proj in 61 of 62 MLA layers to mxfp4 (MLAQ_FP4BMM=1; rule family-opt-in)"
        )
    )
    assert "1 mxfp4 (rule checkpoint)" in records[0].getMessage()


def test_one_info_line_otherwise(caplog):
    caplog.set_level(logging.INFO, logger="mlaq.policy")
    decide_from_dir(FIXTURES / "constructed--GLM-5.2-MXFP4", BOTH)
    records = [r for r in caplog.records if r.name == "mlaq.policy"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert records[0].getMessage() == "kv_b_proj re-quantized in none of 79 MLA layers: 79 bf16 (rule guard)."


def test_warning_with_mixed_causes(caplog):
    caplog.set_level(logging.INFO, logger="mlaq.policy")
    qc = '{"targets": {"model.layers.0.self_attn.kv_b_proj": "fp8_per_block"}}'
    decide_from_dir(FIXTURES / "zai-org--GLM-4.7-Flash", FP4, qc)
    (record,) = [r for r in caplog.records if r.name == "mlaq.policy"]
    assert record.getMessage().startswith(
        "Re-quantizing kv_b_proj in 48 of 48 MLA layers: 47 to mxfp4 (MLAQ_FP4BMM=1; rule flag), "
        "1 to fp8_per_block (from targets: model.layers.0.self_attn.kv_b_proj)"
    )


def test_log_false_is_silent(caplog):
    caplog.set_level(logging.DEBUG, logger="mlaq.policy")
    decide_from_dir(FIXTURES / "zai-org--GLM-4.7-Flash", FP4, log=False)
    assert not [r for r in caplog.records if r.name == "mlaq.policy"]
