"""The _sm90 schemes against whole BMMs an H200 computed: fp8_per_block_sm90 against a Triton kernel with
DeepGEMM's loop (tests/fixtures/h200_fp8_dots.safetensors, bench/fp8_hardware.py --dump), bf16_sm90 against
cuBLAS's bf16 torch.bmm (h200_bf16_dots.safetensors, bench/bf16_hardware.py --dump); and check_kernel."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mlaq.bmm import check_kernel, get_scheme

DOTS = Path(__file__).parent / "fixtures" / "h200_fp8_dots.safetensors"
BF16_DOTS = Path(__file__).parent / "fixtures" / "h200_bf16_dots.safetensors"


@pytest.fixture(scope="module")
def dots() -> dict[str, torch.Tensor]:
    return load_file(DOTS)


@pytest.mark.parametrize("k", [192, 512])
def test_matches_the_h200_bit_for_bit(dots, k):
    x, w = dots[f"per_block_k{k}_x"], dots[f"per_block_k{k}_w"].float()
    sm90 = get_scheme("fp8_per_block_sm90")
    got = sm90.apply(x, sm90.prepare(w))
    assert torch.equal(got, dots[f"per_block_k{k}_triton"])
    exact = get_scheme("fp8_per_block")
    assert not torch.equal(exact.apply(x, exact.prepare(w)), got)  # exact sums are another arithmetic


@pytest.mark.parametrize("k", [128, 512])
def test_bf16_sm90_matches_cublas_bit_for_bit(k):
    dots = load_file(BF16_DOTS)
    x, w, want = dots[f"bmm_k{k}_x"], dots[f"bmm_k{k}_w"].float(), dots[f"bmm_k{k}_cublas"].float()
    sm90 = get_scheme("bf16_sm90")
    assert torch.equal(sm90.apply(x, sm90.prepare(w)), want)
    bf16 = get_scheme("bf16")
    exact = bf16.apply(x, bf16.prepare(w))
    differ = int((exact != want).sum())
    assert 0 < differ < 0.002 * want.numel()  # exact sums: a handful of bf16 outputs one step apart


def test_bf16_sm90_refuses_another_schemes_weight():
    w = torch.randn(2, 32, 16)
    with pytest.raises(ValueError, match="bf16_sm90 needs a weight prepared by bf16_sm90"):
        get_scheme("bf16_sm90").apply(torch.randn(2, 3, 32), get_scheme("bf16").prepare(w))


def test_the_fma_promotion_is_what_the_hardware_does(dots):
    """With the compiler's FMA contraction off, the same kernel rounds twice and differs somewhere."""
    differs = 0
    for k in (192, 512):
        differs += int((dots[f"per_block_k{k}_triton"] != dots[f"per_block_k{k}_triton_no_fusion"]).sum())
    assert differs > 0


def test_same_weight_codes_as_fp8_per_block():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 192, 64, generator=g)
    a, b = get_scheme("fp8_per_block").prepare(w), get_scheme("fp8_per_block_sm90").prepare(w)
    assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)) and torch.equal(a.scale, b.scale)
    assert b.scheme == "fp8_per_block_sm90"


def test_e4m3fn_only():
    from mlaq.bmm.sm90 import Fp8PerBlockSm90
    from mlaq.formats import Fp8Dtype

    with pytest.raises(ValueError, match="e4m3fn only"):
        Fp8PerBlockSm90(Fp8Dtype.E4M3FNUZ)


def _as_sm90(x, prepared):
    """A stand-in for a DeepGEMM kernel on an H100: Hopper's arithmetic on fp8_per_block's weight."""
    sm90 = get_scheme("fp8_per_block_sm90")
    return sm90.apply(x, dataclasses.replace(prepared, scheme=sm90.name))


def test_check_kernel_points_a_hopper_kernel_to_the_sm90_scheme():
    shapes = [(4, 64, 192, 64), (2, 16, 512, 64)]
    against_exact = check_kernel(_as_sm90, "fp8_per_block", shapes)
    assert not against_exact.passed  # fp32-order tolerance cannot hold 13-bit sums
    assert "fp8_per_block_sm90" in against_exact.format()
    against_sm90 = check_kernel(_as_sm90, "fp8_per_block_sm90", shapes)
    assert against_sm90.passed and all(c.max_ulps == 0 for c in against_sm90.checks)
    bf16 = check_kernel(get_scheme("bf16").apply, "bf16", shapes)
    assert "fp8_per_block_sm90" not in bf16.format()
