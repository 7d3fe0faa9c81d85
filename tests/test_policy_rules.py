"""Decision-procedure corner cases: source precisions, scheme availability, reasons, the result object."""

import pytest

from mlaq.policy import LayerDecision, PolicyResult, Rule, decide, mla_model
from mlaq.policy.checkpoint import NoQuant
from mlaq.policy.fp8 import Fp8Quant
from mlaq.policy.quark import QuarkQuant
from mlaq.settings import Settings

ARCH = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 2,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
}
MX = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0"}
ALL = (Settings(), Settings(fp8bmm=True), Settings(fp4bmm=True), Settings(True, True))


def model(dtype: str = "bfloat16", model_type: str = "deepseek_v3"):
    return mla_model({**ARCH, "torch_dtype": dtype, "model_type": model_type})


def one(result: PolicyResult) -> tuple[str, str, str]:
    got = {(d.source, d.scheme, d.rule.value) for d in result.layers}
    assert len(got) == 1, got
    return got.pop()


@pytest.mark.parametrize(
    "settings, expected",
    [
        (Settings(), ("fp32", "fp32", "default")),
        (Settings(fp4bmm=True), ("fp32", "fp32", "default")),  # FP4 needs a bf16/fp16 source
        (Settings(fp8bmm=True), ("fp32", "fp8_per_tensor", "flag")),
        (Settings(True, True), ("fp32", "fp8_per_tensor", "flag")),  # FP4 cannot, so FP8 applies
    ],
)
def test_fp32_source(settings, expected):
    assert one(decide(model("float32"), NoQuant(), settings)) == expected


def test_fp32_source_reasons_say_why_fp4_did_not_apply():
    r = decide(model("float32"), NoQuant(), Settings(fp4bmm=True))
    assert r.layers[0].reason.startswith("MLAQ_FP4BMM=1 needs a bf16/fp16 source and this weight is fp32")
    r = decide(model("float32"), NoQuant(), Settings(True, True))
    assert r.layers[0].reason.startswith("MLAQ_FP4BMM=1 needs a bf16/fp16 source and this weight is fp32, so")


def test_fp16_source_runs_as_fp32_without_an_fp16_scheme():
    r = decide(model("float16"), NoQuant(), Settings())
    assert one(r) == ("fp16", "fp32", "default") and "fp32 holds fp16 exactly" in r.layers[0].reason
    assert one(decide(model("float16"), NoQuant(), Settings(fp4bmm=True))) == ("fp16", "mxfp4", "flag")


def test_flag_scheme_must_be_registered():
    with pytest.raises(
        ValueError, match="MLAQ_FP4BMM=1 asks for scheme mxfp4, which this mlaq build does not"
    ):
        decide(model(), NoQuant(), Settings(fp4bmm=True), schemes=("fp32", "bf16"))
    # the guard does not need the flag's scheme
    q = Fp8Quant.parse({"quant_method": "fp8", "modules_to_not_convert": ["re:.*kv_b_proj"]})
    assert one(decide(model(), q, Settings(fp4bmm=True), schemes=("fp32", "bf16"))) == (
        "bf16",
        "bf16",
        "guard",
    )


def test_checkpoint_scheme_must_be_registered():
    q = Fp8Quant.parse({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match=r"its scheme fp8_per_block is not registered"):
        decide(model(), q, Settings(), schemes=("fp32", "bf16"))


@pytest.mark.parametrize("settings", ALL)
def test_quark_glm_never_opts_in(settings):
    q = QuarkQuant.parse(
        {"quant_method": "quark", "global_quant_config": {"weight": MX}, "exclude": ["re:.*attn.*"]}
    )
    src, scheme, rule = one(decide(model(model_type="glm_moe_dsa"), q, settings))
    assert (src, scheme) == ("bf16", "bf16") and rule == ("default" if settings == Settings() else "guard")


def test_quark_fp8_global_does_not_opt_in():
    w = {"dtype": "fp8_e4m3", "qscheme": "per_channel"}
    q = QuarkQuant.parse(
        {"quant_method": "quark", "global_quant_config": {"weight": w}, "exclude": ["*self_attn*"]}
    )
    assert not q.family_opt_in("deepseek_v3")
    assert one(decide(model(), q, Settings(fp4bmm=True))) == ("bf16", "bf16", "guard")


def test_reasons_are_single_sentences_and_name_the_cause():
    q = QuarkQuant.parse(
        {"quant_method": "quark", "global_quant_config": {"weight": MX}, "exclude": ["re:.*attn.*"]}
    )
    for settings in ALL:
        for ckpt in (q, NoQuant(), Fp8Quant.parse({"quant_method": "fp8", "weight_block_size": [128, 128]})):
            for mt in ("deepseek_v3", "glm_moe_dsa"):
                for d in decide(model(model_type=mt), ckpt, settings).layers:
                    assert d.reason.endswith(".") and d.reason.count(". ") == 0, d.reason
    glm = decide(model(model_type="glm_moe_dsa"), q, Settings(True, True)).layers[0].reason
    assert "exclude lists 're:.*attn.*'" in glm and "MLAQ_FP4BMM=1 and MLAQ_FP8BMM=1 not applied" in glm
    fam = decide(model(), q, Settings(fp8bmm=True)).layers[0].reason
    assert "set MLAQ_FP4BMM=1 for the MXFP4 the checkpoint intends" in fam


def test_result_object():
    r = decide(model(), NoQuant(), Settings(fp4bmm=True))
    assert isinstance(r.for_layer(2), LayerDecision) and r.for_layer(2).mtp and not r.for_layer(1).mtp
    with pytest.raises(ValueError, match="layer 3 is not an MLA layer"):
        r.for_layer(3)
    d = r.for_layer(0)
    assert d.rule is Rule.FLAG and d.requantized and not d.uses_checkpoint_data
    assert set(d.to_json()) == {"layer", "module", "source", "scheme", "rule", "reason"}
    j = r.to_json()
    assert list(j) == ["model_type", "settings", "layers"]
    assert j["settings"] == {"MLAQ_FP8BMM": False, "MLAQ_FP4BMM": True, "quantization_config": None}
    assert [x["layer"] for x in j["layers"]] == [0, 1, 2]
