"""The sm90 tensor-core models against an H200's own outputs (tests/fixtures/h200_fp8_dots.safetensors,
h200_bf16_dots.safetensors), and the fp32 FMA against exact rational arithmetic."""

from __future__ import annotations

import itertools
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from mlaq.bmm.tensor_core import fma_fp32, sm90_bf16_dot, sm90_fp8_dot

DOTS = Path(__file__).parent / "fixtures" / "h200_fp8_dots.safetensors"
BF16_DOTS = Path(__file__).parent / "fixtures" / "h200_bf16_dots.safetensors"
SETS = [f"{kind}_k{k}" for kind, k in itertools.product(("normal", "wide", "positive"), (16, 32, 64, 128))]
BF16_SETS = [
    f"{kind}_k{k}" for kind, k in itertools.product(("normal", "wide", "positive"), (16, 32, 64, 128, 512))
]


@pytest.fixture(scope="module")
def dots() -> dict[str, torch.Tensor]:
    return load_file(DOTS)


def _operands(dots, tag):
    a = dots[f"{tag}_a"].view(torch.float8_e4m3fn).float()  # (64, K)
    b = dots[f"{tag}_b"].view(torch.float8_e4m3fn).float()  # (K, 64)
    return a[None], b[None], dots[f"{tag}_c"][None]


@pytest.mark.parametrize("tag", SETS)
def test_matches_h200_bit_for_bit(dots, tag):
    a, b, c = _operands(dots, tag)
    want = dots[f"{tag}_scaled_mm"][None]  # cuBLASLt, C = 0
    assert torch.equal(sm90_fp8_dot(a, b), want)
    if f"{tag}_triton" in dots:  # Triton's tl.dot: the same wgmma, and with a random fp32 accumulator
        assert torch.equal(sm90_fp8_dot(a, b), dots[f"{tag}_triton"][None])
        assert torch.equal(sm90_fp8_dot(a, b, c), dots[f"{tag}_triton_c"][None])


@pytest.mark.parametrize("tag", [t for t in SETS if not t.endswith("k16")])
def test_promotion_every_k_step_matches_h200(dots, tag):
    """Triton's max_num_imprecise_acc=32: each 32-step from zero, then an fp32 add into C."""
    a, b, c = _operands(dots, tag)
    for with_c in (False, True):
        acc = c.clone() if with_c else torch.zeros_like(c)
        for k0 in range(0, a.shape[2], 32):
            acc = acc + sm90_fp8_dot(a[:, :, k0 : k0 + 32], b[:, k0 : k0 + 32])
        want = dots[f"{tag}_triton_imprecise32{'_c' if with_c else ''}"][None]
        assert torch.equal(acc, want)


@pytest.fixture(scope="module")
def bf16_dots() -> dict[str, torch.Tensor]:
    return load_file(BF16_DOTS)


@pytest.mark.parametrize("tag", BF16_SETS)
def test_bf16_matches_h200_bit_for_bit(bf16_dots, tag):
    """16 products a step, aligned to 2^-25 of the largest, truncated to fp32: cuBLAS and Triton alike."""
    a, b, c = bf16_dots[f"{tag}_a"][None], bf16_dots[f"{tag}_b"][None], bf16_dots[f"{tag}_c"][None]
    assert torch.equal(sm90_bf16_dot(a, b), bf16_dots[f"{tag}_triton"][None])
    assert torch.equal(sm90_bf16_dot(a, b, c), bf16_dots[f"{tag}_triton_c"][None])
    assert torch.equal(sm90_bf16_dot(a, b), bf16_dots[f"{tag}_cublas_fp32"][None])


def test_bf16_exact_summation_would_not_match(bf16_dots):
    a, b = bf16_dots["normal_k512_a"][None], bf16_dots["normal_k512_b"][None]
    exact = torch.bmm(a.double(), b.double()).float()
    assert (exact != bf16_dots["normal_k512_triton"][None]).float().mean() > 0.9


def test_exact_summation_would_not_match(dots):
    """The hardware really differs from exact-then-round-once (else the tests above prove nothing)."""
    a, b, _ = _operands(dots, "normal_k128")
    exact = torch.bmm(a.double(), b.double()).float()
    assert (exact != dots["normal_k128_scaled_mm"][None]).float().mean() > 0.9


def test_low_ten_bits_zero_and_truncation_toward_zero():
    g = torch.Generator().manual_seed(1)
    a = (torch.rand(2, 8, 96, generator=g) * 400).to(torch.float8_e4m3fn).float()
    b = (torch.rand(2, 96, 16, generator=g) * 400).to(torch.float8_e4m3fn).float()
    out = sm90_fp8_dot(a, b)
    assert ((out.view(torch.int32) & 0x3FF) == 0).all()
    assert (out.double() <= torch.bmm(a.double(), b.double())).all()  # positive terms: never rounds up


def test_single_product_and_zeros_are_exact():
    a = torch.zeros(1, 1, 32)
    b = torch.zeros(1, 32, 1)
    assert sm90_fp8_dot(a, b).item() == 0.0
    a[0, 0, 5], b[0, 5, 0] = 448.0, -0.001953125  # e4m3fn max times the smallest subnormal
    assert sm90_fp8_dot(a, b).item() == 448.0 * -0.001953125


def test_all_zero_products_keep_the_accumulator_on_its_grid():
    """No product to align to: the accumulator alone sets the grid (a tiny one must not overflow the scale)."""
    acc = torch.tensor([[[1e-40, -3.0000002, 0.0]]])
    out = sm90_fp8_dot(torch.zeros(1, 1, 64), torch.zeros(1, 64, 3), acc)
    assert torch.isfinite(out).all() and out[0, 0, 2] == 0
    assert out[0, 0, 1] == -3.0  # -3.0000002 truncated to 13 fraction bits
    assert 0 < out[0, 0, 0] <= 1e-40


def _fma_exact(a: float, b: float, c: float) -> float:
    """a * b + c in rationals, rounded to fp32 by nearest-even (through numpy's float32 neighbours)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    lo = np.float32(float(exact))  # near; fix up below
    for _ in range(3):
        if Fraction(float(lo)) > exact:
            lo = np.nextafter(lo, np.float32(-np.inf))
        elif Fraction(float(np.nextafter(lo, np.float32(np.inf)))) <= exact:
            lo = np.nextafter(lo, np.float32(np.inf))
    hi = np.nextafter(lo, np.float32(np.inf))
    d_lo, d_hi = exact - Fraction(float(lo)), Fraction(float(hi)) - exact
    if d_lo < d_hi or (d_lo == d_hi and (int(np.float32(lo).view(np.int32)) & 1) == 0):
        return float(lo)
    return float(hi)


def test_fma_fp32_rounds_once():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3000, generator=g)
    b = torch.randn(3000, generator=g) * torch.pow(2.0, torch.randint(-20, 20, (3000,), generator=g).float())
    c = -(a.double() * b.double()).float()  # cancellation: the product's low bits decide
    c[::3] = torch.randn(1000, generator=g) * 1e-3  # and ordinary sums, with ties possible on the fp32 grid
    got = fma_fp32(a, b, c)
    want = torch.tensor(
        [_fma_exact(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)]
    )
    assert torch.equal(got, want)
    twice = a * b + c  # two roundings: differs somewhere, so the test can tell
    assert not torch.equal(twice, want)


def test_fma_fp32_is_not_fooled_by_a_float64_tie():
    """a * b just above 2^-24: 1 + a * b rounds in float64 to 1 + 2^-24, an fp32 tie that rounds to even
    (1.0), while the exact sum lies above it and rounds up. Round-to-odd must keep the difference."""
    k = torch.arange(1, 2**16, dtype=torch.float64)
    a = (1 + k * 2.0**-23).float()
    b = (2.0**-24 / a.double()).float()
    p = a.double() * b.double()
    hit = (p + 1.0 == 1 + 2.0**-24) & (p > 2.0**-24)
    a, b = a[hit][:300], b[hit][:300]
    assert a.numel() >= 100
    one = torch.ones_like(a)
    assert ((a.double() * b.double() + 1.0).float() == 1.0).all()  # the float64 shortcut fails here
    want = torch.tensor([_fma_exact(x, y, 1.0) for x, y in zip(a.tolist(), b.tolist(), strict=True)])
    assert (want > 1.0).all()
    assert torch.equal(fma_fp32(a, b, one), want)
