"""RoPE and DeepSeek YaRN against transformers' rotary code (test-only oracle) and hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3RotaryEmbedding,
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from mlaq.model.layers.rope import (
    Rope,
    RopeLayout,
    YarnScaling,
    apply_rope,
    find_correction_range,
    linear_ramp_mask,
    yarn_get_mscale,
)

V3_YARN = {
    "type": "yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def hf_config(rope_scaling: dict | None, theta: float = 10000.0) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        qk_rope_head_dim=64,
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=163840,
    )


def test_yarn_get_mscale_values():
    assert yarn_get_mscale(1.0, 1.0) == 1.0 and yarn_get_mscale(0.5, 7.0) == 1.0
    assert yarn_get_mscale(40.0, 1.0) == pytest.approx(1 + 0.1 * math.log(40))
    assert yarn_get_mscale(40.0, 0.0) == 1.0


def test_correction_range_deepseek_v3_by_hand():
    # dim(rot) = 64 ln(4096 / (2 pi rot)) / (2 ln 10000): 10.4722 for 32 rotations, 22.5134 for 1
    assert find_correction_range(32, 1, 64, 10000, 4096) == (10, 23)
    low, high = find_correction_range(32, 1, 64, 10000, 4096, truncate=False)
    assert low == pytest.approx(10.4722, abs=1e-4) and high == pytest.approx(22.5134, abs=1e-4)
    ramp = linear_ramp_mask(10, 23, 32)
    assert ramp[:11].eq(0).all() and ramp[23:].eq(1).all() and ramp[16].item() == pytest.approx(6 / 13)


@pytest.mark.parametrize(
    "scaling",
    [
        V3_YARN,
        dict(V3_YARN, mscale=1.0, mscale_all_dim=0.707),  # cos/sin multiplier != 1
        dict(V3_YARN, factor=4, beta_fast=8, beta_slow=2, mscale=0.9, mscale_all_dim=0.4),
        dict(V3_YARN, truncate=False),
    ],
)
def test_yarn_inv_freq_and_cos_sin_scale_match_transformers(scaling):
    cfg = hf_config(dict(scaling))
    ref_inv, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    yarn = YarnScaling(
        factor=scaling["factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
        beta_fast=scaling["beta_fast"],
        beta_slow=scaling["beta_slow"],
        mscale=scaling["mscale"],
        mscale_all_dim=scaling["mscale_all_dim"],
        truncate=scaling.get("truncate", True),
    )
    rope = Rope(64, 10000.0, RopeLayout.INTERLEAVED, yarn)
    assert torch.equal(rope.inv_freq(), ref_inv)  # bit for bit
    assert yarn.cos_sin_scale == pytest.approx(ref_factor, rel=1e-15)
    # the YaRN blend actually changed slow frequencies (the test can fail if yarn were ignored)
    assert not torch.equal(ref_inv, Rope(64, 10000.0).inv_freq())


@pytest.mark.parametrize("scaling", [None, V3_YARN, dict(V3_YARN, mscale_all_dim=0.5)])
def test_cos_sin_match_transformers_rotary_embedding(scaling):
    cfg = hf_config(None if scaling is None else dict(scaling), theta=50000.0)
    hf = DeepseekV3RotaryEmbedding(cfg)
    positions = torch.tensor([[0, 1, 2, 4095, 4096, 100_000], [7, 8, 9, 10, 11, 163_839]])
    cos_ref, sin_ref = hf(torch.zeros(1, dtype=torch.float32), positions)  # (B, T, R) = cat(half, half)
    yarn = None
    if scaling is not None:
        keys = (
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        )
        yarn = YarnScaling(**{k: scaling[k] for k in keys})
    cos, sin = Rope(64, 50000.0, RopeLayout.INTERLEAVED, yarn).cos_sin(positions)
    assert torch.equal(cos, cos_ref[..., :32]) and torch.equal(sin, sin_ref[..., :32])


def test_interleaved_rope_matches_transformers_up_to_its_output_permutation():
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 5, 64), torch.randn(2, 1, 5, 64)  # (B, heads, T, R)
    positions = torch.arange(5).expand(2, 5) * 37
    cfg = hf_config(dict(V3_YARN))
    cos_full, sin_full = DeepseekV3RotaryEmbedding(cfg)(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb_interleave(q, k, cos_full, sin_full)
    rope = Rope(64, 10000.0, RopeLayout.INTERLEAVED, YarnScaling(40, 4096, mscale=1.0, mscale_all_dim=1.0))
    cos, sin = rope.cos_sin(positions)  # (B, T, 32)
    q_out = rope.apply(q, cos[:, None], sin[:, None])
    k_out = rope.apply(k, cos[:, None], sin[:, None])
    # transformers returns [even outputs | odd outputs]; mlaq keeps the pairs interleaved
    deinterleave = torch.cat((torch.arange(0, 64, 2), torch.arange(1, 64, 2)))
    assert torch.equal(q_out[..., deinterleave], q_ref) and torch.equal(k_out[..., deinterleave], k_ref)
    # scores are layout-independent
    torch.testing.assert_close(q_out @ k_out.transpose(-1, -2), q_ref @ k_ref.transpose(-1, -2))


def test_interleaved_rope_matches_deepseek_v2_complex_form():
    torch.manual_seed(1)
    q, k = torch.randn(2, 3, 6, 64), torch.randn(2, 1, 6, 64)  # (B, heads, T, R)
    rope = Rope(64, 10000.0)
    positions = torch.arange(6).expand(2, 6) + 1000
    angles = positions[..., None].float() * rope.inv_freq()  # (B, T, 32)
    freqs_cis = torch.polar(torch.ones_like(angles), angles)
    q_ref, k_ref = apply_rotary_emb(q, k, freqs_cis)
    cos, sin = rope.cos_sin(positions)
    torch.testing.assert_close(rope.apply(q, cos[:, None], sin[:, None]), q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rope.apply(k, cos[:, None], sin[:, None]), k_ref, rtol=1e-6, atol=1e-6)


def test_half_split_rope_matches_transformers_rotate_half():
    torch.manual_seed(2)
    q, k = torch.randn(1, 2, 4, 64), torch.randn(1, 1, 4, 64)
    positions = torch.tensor([[0, 3, 9, 27]])
    cos_full, sin_full = DeepseekV3RotaryEmbedding(hf_config(None))(q, positions)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos_full, sin_full)
    cos, sin = Rope(64, 10000.0).cos_sin(positions)
    assert torch.equal(apply_rope(q, cos[:, None], sin[:, None], RopeLayout.HALF_SPLIT), q_ref)
    assert torch.equal(apply_rope(k, cos[:, None], sin[:, None], RopeLayout.HALF_SPLIT), k_ref)


def test_rope_rotates_norm_preserving_and_relative():
    rope = Rope(8, 10000.0)
    x = torch.randn(3, 8, dtype=torch.float64)
    cos, sin = rope.cos_sin(torch.tensor([5, 6, 7]))
    y = rope.apply(x, cos.double(), sin.double())
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    # <R(a) q, R(b) k> depends on a - b only
    q, k = torch.randn(8), torch.randn(8)

    def score(a: int, b: int) -> float:
        ca, sa = rope.cos_sin(torch.tensor([a]))
        cb, sb = rope.cos_sin(torch.tensor([b]))
        return float(rope.apply(q[None], ca, sa) @ rope.apply(k[None], cb, sb).T)

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)


def test_rope_bf16_rounds_once_from_float32():
    rope = Rope(64, 10000.0)
    x = torch.randn(4, 64).to(torch.bfloat16)
    cos, sin = rope.cos_sin(torch.arange(4))
    y = rope.apply(x, cos, sin)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, rope.apply(x.float(), cos, sin).to(torch.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dim": 63, "theta": 1e4}, "even"),
        ({"dim": 64, "theta": 0.0}, "rope_theta"),
    ],
)
def test_rope_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Rope(**kwargs)


def test_yarn_rejects_bad_values():
    with pytest.raises(ValueError, match="factor"):
        YarnScaling(0.0, 4096)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        YarnScaling(4.0, 0)
    with pytest.raises(ValueError, match="beta"):
        YarnScaling(4.0, 4096, beta_fast=-1)
    with pytest.raises(ValueError, match="angles"):
        apply_rope(torch.zeros(2, 8), torch.zeros(2, 3), torch.zeros(2, 3), RopeLayout.INTERLEAVED)
