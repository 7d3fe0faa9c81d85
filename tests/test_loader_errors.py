"""Bad checkpoints fail with a ValueError / FileNotFoundError naming the file and the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from mlaq.model import load_model
from mlaq.model.loading.checkpoint import SafetensorsCheckpoint
from mlaq.settings import Settings
from model_helpers import edit_config, hf_checkpoint, read_tensors, write_tensors
from quant_helpers import quantize_checkpoint

OFF = Settings(fp8bmm=False, fp4bmm=False)
KV_B = "model.layers.1.self_attn.kv_b_proj.weight"
UP = "model.layers.1.mlp.experts.3.up_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    _, path = hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("pristine"))
    return path


@pytest.fixture
def ckpt(pristine, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pristine, dst)
    return dst


def _rewrite(path, **changes):
    tensors = read_tensors(path)
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value
    write_tensors(path, tensors)


def _load(path):
    return load_model(path, settings=OFF)


def test_missing_tensor(ckpt):
    _rewrite(ckpt, **{UP: None})
    with pytest.raises(ValueError, match=rf"tensor '{UP}' is missing from the checkpoint in .*ckpt"):
        _load(ckpt)


def test_unexpected_shape(ckpt):
    _rewrite(ckpt, **{KV_B: torch.zeros(3, 5)})
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor '{KV_B}'.*unexpected shape \(3, 5\)"):
        _load(ckpt)


def test_dtype_not_allowed(ckpt):
    _rewrite(ckpt, **{"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight'.*dtype int32 is not allowed"):
        _load(ckpt)


def test_fp8_weight_without_scale(ckpt):
    _rewrite(ckpt, **{UP: torch.zeros(32, 64, dtype=torch.float8_e4m3fn)})
    with pytest.raises(ValueError, match=rf"'{UP}'.*no weight_scale_inv / weight_scale.*float8_e4m3fn"):
        _load(ckpt)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight(ckpt, bad):
    w = read_tensors(ckpt)[UP].clone()
    w[2, 3] = bad
    _rewrite(ckpt, **{UP: w})
    with pytest.raises(ValueError, match=rf"tensor '{UP}' holds 1 non-finite value"):
        _load(ckpt)


def test_non_finite_fp8_scale(ckpt):
    quantize_checkpoint(ckpt, "fp8")
    scale = read_tensors(ckpt)[UP.replace("weight", "weight_scale_inv")].clone()
    scale[0, 0] = float("nan")
    _rewrite(ckpt, **{UP.replace("weight", "weight_scale_inv"): scale})
    with pytest.raises(ValueError, match=rf"'{UP}' scale holds 1 non-finite"):
        _load(ckpt)


def test_truncated_file(ckpt):
    file = ckpt / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-1000])
    with pytest.raises(ValueError, match=r"model\.safetensors: corrupt or truncated safetensors file"):
        _load(ckpt)


def test_garbage_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        _load(ckpt)


def test_no_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        _load(ckpt)


def test_broken_index(ckpt):
    tensors = read_tensors(ckpt)
    write_tensors(ckpt, tensors, shards=2)
    index = ckpt / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    (ckpt / data["weight_map"][UP]).unlink()
    with pytest.raises(FileNotFoundError, match=r"names shard.* that do not exist: model-0000"):
        _load(ckpt)
    index.write_text("[]")
    with pytest.raises(ValueError, match="not a safetensors index"):
        _load(ckpt)


def test_tensor_stored_twice(ckpt):
    tensors = read_tensors(ckpt)
    write_tensors(ckpt, tensors, shards=2)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][UP])
    extra = read_tensors(ckpt)  # rewrite one shard with a duplicate of UP
    shard = {k: v for k, v in extra.items() if index["weight_map"][k] == other} | {UP: extra[UP]}
    save_file(shard, str(ckpt / other))
    with pytest.raises(ValueError, match=rf"tensor '{UP}' is stored twice"):
        _load(ckpt)


def test_config_and_weights_disagree(ckpt):
    quantize_checkpoint(ckpt, "compressed-tensors", strategy="channel")
    edit_config(ckpt, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(
        ValueError, match=r"stored as fp8_per_channel, which quantization_config quant_method 'fp8'"
    ):
        _load(ckpt)


def test_kv_b_proj_format_disagrees_with_config(ckpt):
    expected = quantize_checkpoint(ckpt, "fp8")  # config says kv_b_proj is block FP8 ...
    tensors = read_tensors(ckpt)
    tensors[KV_B] = expected[KV_B]  # ... but the file holds it dense
    del tensors[KV_B.replace("weight", "weight_scale_inv")]
    write_tensors(ckpt, tensors)
    with pytest.raises(
        ValueError, match=r"kv_b_proj\.weight: config\.json says kv_b_proj is stored as fp8_per_block"
    ):
        _load(ckpt)


def test_unloadable_quant_method(ckpt):
    edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="gptq"):
        _load(ckpt)


def test_modelopt_weights_are_refused(ckpt):
    (ckpt / "hf_quant_config.json").write_text('{"quantization": {"quant_algo": "NVFP4"}}')
    with pytest.raises(ValueError, match=r"hf_quant_config\.json: ModelOpt checkpoints"):
        _load(ckpt)


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, model_type="qwen3_moe")
    with pytest.raises(ValueError, match="unsupported model_type 'qwen3_moe'; mlaq supports: deepseek_v2"):
        _load(ckpt)


def test_lazy_reads_one_tensor_at_a_time(ckpt):
    """The reader maps files and hands out one tensor per call (no whole-checkpoint dict)."""
    with SafetensorsCheckpoint(ckpt) as reader:
        assert reader.has(UP) and UP in list(reader.keys()) and reader.shape(UP) == (32, 64)
        assert torch.equal(reader.get(UP), read_tensors(ckpt)[UP])
        with pytest.raises(ValueError, match="missing"):
            reader.get("nope")
