"""RMSNorm: the fused float32 call equals the explicit formula bit for bit; bf16 rounds before the weight."""

from __future__ import annotations

import pytest
import torch

from mlaq.model.layers.norm import RMSNorm


def formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("hidden", [64, 192, 256, 7168])
def test_float32_fast_path_is_bit_identical(hidden):
    g = torch.Generator().manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    for t, scale in ((1, 1e-3), (3, 1.0), (17, 1e3)):
        x = scale * torch.randn(2, t, hidden, generator=g)
        assert torch.equal(norm(x), formula(x, norm.weight, 1e-6))


def test_bf16_rounds_the_normalized_input_before_the_weight():
    norm = RMSNorm(64, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64))
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert torch.equal(norm(x), formula(x, norm.weight, 1e-6))
