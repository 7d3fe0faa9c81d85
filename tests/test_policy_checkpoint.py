"""Checkpoint quantization parsing: how each method says kv_b_proj is stored, per layer."""

import json
from pathlib import Path

import pytest

from mlaq.policy import checkpoint_quant, mla_model, read_checkpoint_dir
from mlaq.policy.checkpoint import NoQuant, UnknownQuant
from mlaq.policy.compressed_tensors import CompressedTensorsQuant
from mlaq.policy.fp8 import Fp8Quant
from mlaq.policy.model_config import layer_ranges
from mlaq.policy.modelopt import ModelOptQuant
from mlaq.policy.quark import QuarkQuant

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
ARCH = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "num_nextn_predict_layers": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "torch_dtype": "bfloat16",
}
MX = {"dtype": "fp4", "qscheme": "per_group", "group_size": 32, "scale_format": "e8m0", "is_dynamic": False}


def write(tmp_path: Path, config: dict, hf_quant: dict | None = None, index: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


def storages(path: Path) -> list:
    files = read_checkpoint_dir(path)
    model = mla_model(files.config, files.layers_prefix)
    q = checkpoint_quant(files)
    return [q.kv_b_proj(model.kv_b_proj(i), model.dtype) for i in model.layer_indices]


def names(path: Path) -> list[str]:
    return [s.stored.name for s in storages(path)]


def test_model_structure_from_fixture():
    files = read_checkpoint_dir(FIXTURES / "zai-org--GLM-5.1-FP8")
    m = mla_model(files.config)
    assert (m.model_type, m.num_hidden_layers, m.num_nextn_predict_layers, m.num_mla_layers) == (
        "glm_moe_dsa",
        78,
        1,
        79,
    )
    assert m.kv_b_proj(78) == "model.layers.78.self_attn.kv_b_proj" and m.is_mtp(78) and not m.is_mtp(77)
    assert m.dtype == "bf16"


def test_no_q_lora_uses_q_proj(tmp_path):
    m = mla_model({**ARCH, "q_lora_rank": None})
    assert m.attn_linears(0) == tuple(
        f"model.layers.0.self_attn.{n}" for n in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    )
    assert "model.layers.0.self_attn.q_a_proj" in mla_model(ARCH).attn_linears(0)


def test_not_mla_is_an_error():
    with pytest.raises(ValueError, match="no kv_lora_rank: not a Multi-head Latent Attention model"):
        mla_model({"model_type": "llama", "num_hidden_layers": 2})


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory; mlaq does not download"):
        read_checkpoint_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        read_checkpoint_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_checkpoint_dir(tmp_path)


def test_layer_ranges():
    assert layer_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert layer_ranges(range(62)) == "0-61"


def test_layers_prefix_from_safetensors_index(tmp_path):
    index = {"weight_map": {"language_model.model.layers.0.self_attn.kv_b_proj.weight": "a.safetensors"}}
    files = read_checkpoint_dir(write(tmp_path, ARCH, index=index))
    assert mla_model(files.config, files.layers_prefix).kv_b_proj(2) == (
        "language_model.model.layers.2.self_attn.kv_b_proj"
    )


# --- real fixtures -------------------------------------------------------------------------------


def test_deepseek_v3_fp8_block_everywhere_incl_mtp():
    s = storages(FIXTURES / "deepseek-ai--DeepSeek-V3")
    assert len(s) == 62 and {x.stored.name for x in s} == {"fp8_per_block"}
    assert s[61].stored.block_size == (128, 128) and not s[61].left_unquantized


def test_glm51_fp8_modules_to_not_convert_leaves_kv_b_quantized():
    q = checkpoint_quant(read_checkpoint_dir(FIXTURES / "zai-org--GLM-5.1-FP8"))
    assert isinstance(q, Fp8Quant) and len(q.not_converted) == 712
    assert set(names(FIXTURES / "zai-org--GLM-5.1-FP8")) == {"fp8_per_block"}


def test_modelopt_hf_quant_config_excludes_self_attn():
    path = FIXTURES / "nvidia--DeepSeek-V3-0324-NVFP4"
    q = checkpoint_quant(read_checkpoint_dir(path))
    assert isinstance(q, ModelOptQuant) and q.quant_algo == "NVFP4" and q.source == "hf_quant_config.json"
    s = storages(path)
    assert {x.stored.name for x in s} == {"bf16"} and all(x.left_unquantized for x in s)
    assert "model.layers.61*" in s[61].because and "model.layers.5.self_attn*" in s[5].because


def test_quark_v32_excludes_self_attn_and_mtp():
    path = FIXTURES / "quark-mxfp4--DeepSeek-V3.2"
    q = checkpoint_quant(read_checkpoint_dir(path))
    assert isinstance(q, QuarkQuant) and q.global_weight_dtype == "fp4"
    assert q.family_opt_in("deepseek_v32") and q.family_opt_in("deepseek_v3")
    assert not q.family_opt_in("glm_moe_dsa")
    s = storages(path)
    assert {x.stored.name for x in s} == {"bf16"} and all(x.left_unquantized for x in s)


def test_glm47_flash_has_no_quant():
    assert isinstance(checkpoint_quant(read_checkpoint_dir(FIXTURES / "zai-org--GLM-4.7-Flash")), NoQuant)


def test_constructed_r1_mxfp4_mtp_stored_mxfp4():
    s = storages(FIXTURES / "constructed--DeepSeek-R1-0528-MXFP4")
    assert [x.stored.name for x in s] == ["bf16"] * 61 + ["mxfp4"]
    assert s[61].stored.scheme == "mxfp4"  # W4A4: input_tensors fp4


# --- constructed per-method cases ----------------------------------------------------------------


def test_fp8_per_tensor_without_block_size_and_ue8m0(tmp_path):
    write(tmp_path, {**ARCH, "quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    assert set(names(tmp_path)) == {"fp8_per_tensor"}
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    write(tmp_path, {**ARCH, "quantization_config": qc})
    assert storages(tmp_path)[0].stored.scale_fmt == "ue8m0"


def test_fp8_parent_module_in_ignored_layers(tmp_path):
    qc = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "ignored_layers": ["model.layers.2.self_attn"],
    }
    write(tmp_path, {**ARCH, "quantization_config": qc})
    assert names(tmp_path) == ["fp8_per_block"] * 2 + ["bf16"] + ["fp8_per_block"] * 2


@pytest.mark.parametrize("bad", [[128], [128, 0], "128x128", [128, 128.0]])
def test_fp8_bad_block_size(tmp_path, bad):
    write(tmp_path, {**ARCH, "quantization_config": {"quant_method": "fp8", "weight_block_size": bad}})
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        storages(tmp_path)


def test_quark_layer_quant_config_and_weight_only(tmp_path):
    qc = {
        "quant_method": "quark",
        "global_quant_config": {"weight": MX, "input_tensors": None},
        "exclude": ["lm_head", "model.layers.0.self_attn"],
        "layer_quant_config": {
            "*layers.1.self_attn.kv_b_proj": {"weight": {"dtype": "fp8_e4m3", "qscheme": "per_tensor"}},
            "model.layers.2.*": {"weight": None},
        },
    }
    write(tmp_path, {**ARCH, "quantization_config": qc})
    s = storages(tmp_path)
    assert [x.stored.name for x in s] == ["bf16", "fp8_per_tensor", "bf16", "mxfp4", "mxfp4"]
    assert s[3].stored.scheme == "mxfp4_w4a16"  # weight-only MXFP4
    assert s[0].left_unquantized and s[2].left_unquantized and not s[3].left_unquantized
    assert "layer_quant_config['model.layers.2.*']" in s[2].because


def test_quark_old_mx_dtype_spelling(tmp_path):
    w = {"dtype": "mx", "mx_element_dtype": "fp4", "qscheme": "per_group", "group_size": 32}
    qc = {"quant_method": "quark", "global_quant_config": {"weight": w, "input_tensors": w}, "exclude": []}
    write(tmp_path, {**ARCH, "quantization_config": qc})
    assert set(names(tmp_path)) == {"mxfp4"}
    assert checkpoint_quant(read_checkpoint_dir(tmp_path)).family_opt_in("deepseek_v3")


def test_compressed_tensors_linear_class_target_and_strategies(tmp_path):
    def ct(weights, ignore=(), act=None, targets=("Linear",)):
        group = {"targets": list(targets), "weights": weights, "input_activations": act}
        qc = {
            "quant_method": "compressed-tensors",
            "config_groups": {"group_0": group},
            "ignore": list(ignore),
        }
        write(tmp_path, {**ARCH, "quantization_config": qc})
        return storages(tmp_path)

    fp8 = {"num_bits": 8, "type": "float"}
    assert ct({**fp8, "strategy": "channel"})[0].stored.name == "fp8_per_channel"
    assert ct({**fp8, "strategy": "tensor"})[0].stored.name == "fp8_per_tensor"
    blk = ct({**fp8, "strategy": "block", "block_structure": [128, 128]})[0].stored
    assert (blk.name, blk.block_size) == ("fp8_per_block", (128, 128))
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group"}
    assert ct({**fp4, "group_size": 16})[0].stored.name == "nvfp4"
    assert ct({**fp4, "group_size": 16})[0].stored.scheme is None
    mx = ct({**fp4, "group_size": 32}, act={"num_bits": 4, "type": "float"})[0].stored
    assert (mx.name, mx.scheme) == ("mxfp4", "mxfp4")
    s = ct({**fp8, "strategy": "channel"}, ignore=["re:.*self_attn.*"])
    assert {x.stored.name for x in s} == {"bf16"} and "ignore lists 're:.*self_attn.*'" in s[0].because
    s = ct({**fp8, "strategy": "channel"}, targets=["re:.*mlp.*"])  # attention not targeted
    assert s[0].stored.name == "bf16" and s[0].left_unquantized and "no config_groups" in s[0].because
    assert ct({"num_bits": 4, "type": "int", "strategy": "group"})[0].stored.name == "int4"


def test_compressed_tensors_constructed_fixture():
    path = FIXTURES / "constructed--DeepSeek-V3-FP8-dynamic-ct"
    assert isinstance(checkpoint_quant(read_checkpoint_dir(path)), CompressedTensorsQuant)
    assert {s.stored.name for s in storages(path)} == {"bf16"}


def test_modelopt_in_config_json_and_mixed_precision(tmp_path):
    qc = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {
            "model.layers.0.self_attn.kv_b_proj": {"quant_algo": "FP8"},
            "model.layers.1.self_attn.kv_b_proj": {"quant_algo": "NVFP4"},
        },
    }
    write(tmp_path, {**ARCH, "quantization_config": qc})
    assert names(tmp_path) == ["fp8_per_tensor", "nvfp4", "bf16", "bf16", "bf16"]
    write(tmp_path, {**ARCH, "quantization_config": {"quant_method": "modelopt", "quant_algo": None}})
    assert all(s.left_unquantized for s in storages(tmp_path))


def test_text_config_nesting(tmp_path):
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    write(tmp_path, {"model_type": "kimi_vl", "text_config": {**ARCH, "quantization_config": qc}})
    files = read_checkpoint_dir(tmp_path)
    assert mla_model(files.config).model_type == "deepseek_v3"
    assert set(names(tmp_path)) == {"fp8_per_block"}


def test_config_json_wins_over_hf_quant_config(tmp_path):
    hq = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}
    write(tmp_path, {**ARCH, "quantization_config": {"quant_method": "fp8"}}, hf_quant=hq)
    assert isinstance(checkpoint_quant(read_checkpoint_dir(tmp_path)), Fp8Quant)


def test_unknown_method_and_missing_method(tmp_path):
    write(tmp_path, {**ARCH, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    q = checkpoint_quant(read_checkpoint_dir(tmp_path))
    assert isinstance(q, UnknownQuant) and not storages(tmp_path)[0].stored.known
    write(tmp_path, {**ARCH, "quantization_config": {"bits": 4}})
    with pytest.raises(ValueError, match="has no quant_method"):
        checkpoint_quant(read_checkpoint_dir(tmp_path))
