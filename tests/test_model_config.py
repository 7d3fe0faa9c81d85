"""ModelConfig: real published configs, transformers' defaults per model_type, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from mlaq.model import ModelConfig, supported_model_types
from mlaq.model.registry import IndexerKind, MlpKind, ScoringFunc, TopkMethod

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def test_deepseek_v3_published_config():
    cfg = ModelConfig.from_dir(CONFIGS / "deepseek-ai--DeepSeek-V3")
    assert cfg.model_type == "deepseek_v3" and cfg.num_layers_total == 62
    assert cfg.mlp_kinds[:4] == (MlpKind.DENSE,) * 3 + (MlpKind.SPARSE,)
    assert cfg.mlp_kind(61) is MlpKind.SPARSE  # the MTP layer is an MoE layer
    moe = cfg.moe
    assert (moe.n_group, moe.topk_group, moe.num_experts_per_tok) == (8, 4, 8)
    assert (moe.scoring_func, moe.topk_method) == (ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC)
    assert moe.routed_scaling_factor == 2.5 and moe.norm_topk_prob
    assert cfg.indexer is None and cfg.q_lora_rank == 1536


def test_glm5_published_config():
    cfg = ModelConfig.from_dir(CONFIGS / "zai-org--GLM-5.1-FP8")
    assert cfg.model_type == "glm_moe_dsa" and cfg.rms_norm_eps == 1e-5
    assert (cfg.qk_nope_head_dim, cfg.v_head_dim) == (192, 256)
    idx = cfg.indexer
    assert (idx.n_heads, idx.head_dim, idx.topk, idx.rope_interleave) == (32, 128, 2048, True)
    assert set(idx.kinds) == {IndexerKind.FULL}  # no indexer_types / pattern: every layer runs its own
    assert cfg.indexer_kind(78) is IndexerKind.FULL  # the MTP layer


def test_glm47_flash_and_deepseek_v32_configs():
    flash = ModelConfig.from_dir(CONFIGS / "zai-org--GLM-4.7-Flash")
    assert flash.mlp_kinds[:2] == (MlpKind.DENSE, MlpKind.SPARSE)
    assert (flash.moe.n_group, flash.moe.routed_scaling_factor) == (1, 1.8)
    v32 = ModelConfig.from_dir(CONFIGS / "quark-mxfp4--DeepSeek-V3.2" / "config.json")
    assert v32.indexer.rope_interleave is False  # V3.2's indexer rotates half-split (transformers)
    assert v32.indexer.n_heads == 64


@pytest.mark.parametrize(
    ("model_type", "cls"),
    [
        ("deepseek_v2", "DeepseekV2Config"),
        ("deepseek_v3", "DeepseekV3Config"),
        ("deepseek_v32", "DeepseekV32Config"),
        ("glm_moe_dsa", "GlmMoeDsaConfig"),
        ("glm4_moe_lite", "Glm4MoeLiteConfig"),
    ],
)
def test_defaults_are_transformers_defaults(model_type, cls):
    """With only the geometry given, every behavioural field reads as transformers reads it."""
    geometry = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 5,
        "num_attention_heads": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
    }
    if model_type in ("deepseek_v32", "glm_moe_dsa"):
        geometry |= {"index_topk": 4, "index_n_heads": 2, "index_head_dim": 16}
    ref = getattr(transformers, cls)(**geometry)
    cfg = ModelConfig.from_dict({"model_type": model_type, **geometry})
    kinds = getattr(ref, "mlp_layer_types", None) or [
        "sparse" if i >= ref.first_k_dense_replace else "dense" for i in range(5)
    ]
    assert [k.value for k in cfg.mlp_kinds] == list(kinds)
    assert cfg.rms_norm_eps == ref.rms_norm_eps
    moe = cfg.moe
    assert moe.n_shared_experts == ref.n_shared_experts
    assert moe.routed_scaling_factor == ref.routed_scaling_factor
    assert moe.norm_topk_prob == bool(ref.norm_topk_prob)
    assert moe.n_group == (ref.n_group or 1) and moe.topk_group == (ref.topk_group or 1)
    if model_type == "deepseek_v2":
        assert (moe.scoring_func, moe.topk_method) == (ScoringFunc.SOFTMAX, TopkMethod.GREEDY)
    else:
        assert (moe.scoring_func, moe.topk_method) == (ScoringFunc.SIGMOID, TopkMethod.NOAUX_TC)


def test_indexer_types_follow_transformers_derivation():
    base = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "index_topk": 4,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "first_k_dense_replace": 6,
    }
    for extra in ({"index_topk_pattern": "FSSFSF"}, {"index_topk_freq": 2, "index_skip_topk_offset": 1}):
        ref = transformers.GlmMoeDsaConfig(**base, **extra)
        cfg = ModelConfig.from_dict({"model_type": "glm_moe_dsa", **base, **extra})
        assert [k.value for k in cfg.indexer.kinds] == ref.indexer_types


def test_multimodal_text_config_is_read():
    inner = _cfg("deepseek-ai--DeepSeek-V3")
    outer = {"model_type": "kimi_k25", "text_config": {**inner, "model_type": "kimi_k2"}}
    assert ModelConfig.from_dict(outer).model_type == "kimi_k2"


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError, match="unsupported model_type 'llama'") as exc:
        ModelConfig.from_dict({**_cfg("deepseek-ai--DeepSeek-V3"), "model_type": "llama"})
    for name in supported_model_types():
        assert name in str(exc.value)


@pytest.mark.parametrize("field", ["kv_lora_rank", "q_lora_rank", "v_head_dim", "num_hidden_layers"])
def test_missing_geometry_field_is_named(field):
    cfg = _cfg("deepseek-ai--DeepSeek-V3")
    del cfg[field]
    with pytest.raises(ValueError, match=f"missing required field.*{field}"):
        ModelConfig.from_dict(cfg, source="ckpt/config.json")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": None}, "unsupported model_type None"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"scoring_func": "relu"}, "'relu' is not a valid ScoringFunc"),
        ({"n_group": 3}, "experts must split evenly"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types has 1 entries"),
        ({"num_experts_per_tok": None}, "missing required field.*num_experts_per_tok"),
        ({"hidden_size": None}, "missing required field.*hidden_size"),
    ],
)
def test_bad_fields(changes, message):
    cfg = {**_cfg("deepseek-ai--DeepSeek-V3"), **changes}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(cfg)


def test_dsa_errors():
    cfg = _cfg("zai-org--GLM-5.1-FP8")
    with pytest.raises(ValueError, match=r"missing required field.*index_topk"):
        ModelConfig.from_dict({k: v for k, v in cfg.items() if k != "index_topk"})
    shared_first = {**cfg, "indexer_types": ["shared"] + ["full"] * 77}
    with pytest.raises(ValueError, match="no earlier layer runs an indexer"):
        ModelConfig.from_dict(shared_first)
    with pytest.raises(ValueError, match="needs q_lora_rank"):
        ModelConfig.from_dict({**cfg, "q_lora_rank": None})


def test_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no 'model_type' field"):
        ModelConfig.from_dir(tmp_path)
