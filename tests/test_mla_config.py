"""MLAConfig: reading real config.json files, the rope conventions per model_type, validation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.rope import RopeLayout, YarnScaling

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def small(**over) -> dict:
    base = {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
    }
    return {**base, **over}


def test_deepseek_v3_config():
    c = MLAConfig.from_hf(load("deepseek-ai--DeepSeek-V3"))
    assert (c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank) == (7168, 128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.latent_dim) == (128, 64, 128, 576)
    assert c.rope_layout is RopeLayout.INTERLEAVED and c.rope_theta == 10000.0
    assert c.rope_scaling == YarnScaling(40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    # 1/sqrt(192) * (0.1 ln 40 + 1)^2 = 0.07217 * 1.3689^2
    assert c.softmax_scale == pytest.approx((1 + 0.1 * math.log(40)) ** 2 / math.sqrt(192), rel=1e-12)
    assert c.softmax_scale == pytest.approx(0.135234, rel=1e-5)
    assert c.rope_scaling.cos_sin_scale == 1.0


def test_glm5_config_uses_rope_parameters_form():
    c = MLAConfig.from_hf(load("zai-org--GLM-5.1-FP8"))
    assert (c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.q_lora_rank) == (64, 192, 256, 2048)
    assert c.rope_theta == 1_000_000.0 and c.rope_scaling is None
    assert c.rope_layout is RopeLayout.INTERLEAVED and c.rms_norm_eps == 1e-5
    assert c.latent_norm_eps == 1e-6  # as transformers' q_a_layernorm / kv_a_layernorm
    assert c.softmax_scale == pytest.approx(1 / 16)  # 1/sqrt(192 + 64)


@pytest.mark.parametrize(
    "name", ["zai-org--GLM-4.7-Flash", "quark-mxfp4--DeepSeek-V3.2", "nvidia--DeepSeek-V3-0324-NVFP4"]
)
def test_other_real_configs_load(name):
    c = MLAConfig.from_hf(load(name))
    assert c.kv_lora_rank == 512 and c.rope_layout is RopeLayout.INTERLEAVED


def test_transformers5_yarn_rope_parameters():
    params = {"rope_type": "yarn", "rope_theta": 5e4, "factor": 8, "original_max_position_embeddings": 2048}
    c = MLAConfig.from_hf(small(rope_parameters=params, rope_theta=1.0))
    assert c.rope_theta == 5e4  # rope_parameters wins over a stray top-level value
    assert c.rope_scaling == YarnScaling(8.0, 2048, 32.0, 1.0, 1.0, 0.0)
    assert c.softmax_scale == pytest.approx(1 / math.sqrt(192))  # mscale_all_dim absent: no extra factor


def test_rope_interleave_flag_per_model_type():
    assert MLAConfig.from_hf(small(rope_interleave=False)).rope_layout is RopeLayout.HALF_SPLIT
    assert (
        MLAConfig.from_hf(small(model_type="glm4_moe_lite", rope_interleave=False)).rope_layout
        is RopeLayout.HALF_SPLIT
    )
    assert MLAConfig.from_hf(small(model_type="deepseek_v2")).rope_layout is RopeLayout.INTERLEAVED
    for model_type in ("deepseek_v2", "deepseek_v32", "glm_moe_dsa"):
        with pytest.raises(ValueError, match="always applies interleaved"):
            MLAConfig.from_hf(small(model_type=model_type, rope_interleave=False))


def test_q_lora_rank_null():
    assert MLAConfig.from_hf(small(q_lora_rank=None)).q_lora_rank is None


def test_num_key_value_heads_is_ignored():
    # transformers' DeepseekV3Config saves num_key_value_heads=128 for any head count; MLA has no KV heads.
    assert MLAConfig.from_hf(small(num_key_value_heads=128)) == MLAConfig.from_hf(small())


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"kv_lora_rank": None}, "no 'kv_lora_rank'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "'linear' is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 2}}, "lacks original_max_position_embeddings"),
        ({"rope_parameters": {"full": {"rope_type": "default"}}}, "one flat dict"),
        ({"qk_rope_head_dim": 63}, "positive even"),
        ({"v_head_dim": 0}, "v_head_dim"),
        ({"q_lora_rank": -3}, "q_lora_rank"),
        ({"rope_theta": -1}, "rope_theta"),
    ],
)
def test_bad_configs_raise_clear_errors(over, match):
    with pytest.raises(ValueError, match=match):
        MLAConfig.from_hf(small(**over))
