"""Properties every BMM scheme shares: registry, output rounding, batch invariance, error vs theory."""

from __future__ import annotations

import math

import pytest
import torch

from mlaq.bmm import get_scheme, scheme_names

QUANTIZED = [n for n in scheme_names() if n not in ("fp32", "bf16")]


def test_registry_names_and_unknown_name():
    names = set(scheme_names())
    assert {
        "fp8_per_tensor",
        "fp8_per_head",
        "fp8_per_channel",
        "fp8_per_block",
        "mxfp4",
        "mxfp4_w4a16",
        "mxfp8",
    } <= names
    assert {"fp8_per_tensor_fnuz", "fp8_per_block_fnuz"} <= names
    with pytest.raises(
        ValueError, match=r"unknown BMM scheme 'mxfp6'; known schemes: .*fp8_per_block.*mxfp8"
    ):
        get_scheme("mxfp6")
    for name in names:
        s = get_scheme(name)
        assert s.name == name and s.description and "." not in s.description[-1:]


@pytest.mark.parametrize("name", scheme_names())
def test_output_rounded_and_dequantize_shape(name):
    s = get_scheme(name)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 200, generator=g), torch.randn(3, 200, 24, generator=g)
    prepared = s.prepare(w)
    y = s.apply(x, prepared)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 24)
    assert torch.equal(y, y.to(s.out_dtype).float())  # values already rounded to the output dtype
    assert prepared.dequantize().shape == (3, 200, 24) and prepared.dequantize().dtype == torch.float32
    assert prepared.dequantize(torch.float64).dtype == torch.float64


@pytest.mark.parametrize("name", scheme_names())
def test_batch_invariance(name):
    """A token's result does not depend on the other tokens of the batch: every activation scale is
    per token (per group of K), and the emulation sums exactly before rounding (an fp32 CPU bmm would
    change its summation order with the batch size). SGLang's per-tensor activation path lacks this."""
    s = get_scheme(name)
    if not s.batch_invariant:
        pytest.skip(
            f"{name} is not batch invariant by design (tests/test_bmm_sglang.py checks that it is not)"
        )
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 33, 192, generator=g) * torch.exp(2 * torch.randn(4, 33, 1, generator=g))).bfloat16()
    prepared = s.prepare(torch.randn(4, 192, 64, generator=g))
    full = s.apply(x, prepared)
    for b in (0, 7, 32):
        assert torch.equal(s.apply(x[:, b : b + 1], prepared), full[:, b : b + 1])
    assert torch.equal(s.apply(x[:, 5:20], prepared), full[:, 5:20])


# Relative RMS error of one element type on N(0,1) (measured on 4096x4096 N(0,1)): e4m3 per-tensor
# 2.65 %, 1x128 2.57 %; MXFP4 EVEN 11.19 %; MXFP8 RCEIL 2.65 %. With independent errors e_x, e_w in
# the two operands, y = sum x_k w_k errs by sqrt(e_x^2 + e_w^2 + e_x^2 e_w^2) relative RMS.
THEORY = {
    "fp8_per_tensor": (0.0257, 0.0265),
    "fp8_per_head": (0.0257, 0.0265),
    "fp8_per_channel": (0.0257, 0.0265),
    "fp8_per_block": (0.0257, 0.0265),
    "mxfp4": (0.1119, 0.1119),
    "mxfp4_w4a16": (0.0, 0.1119),
    "mxfp8": (0.0265, 0.0265),
    "fp8_per_tensor_sglang": (0.0257, 0.0265),
    "fp8_per_tensor_w8a16_sglang": (0.0, 0.0265),
    "fp8_per_tensor_batch_sglang": (0.0265, 0.0265),
}


@pytest.mark.parametrize("name", sorted(THEORY))
def test_error_matches_theory_on_gaussians(name):
    e_x, e_w = THEORY[name]
    theory = math.sqrt(e_x**2 + e_w**2 + e_x**2 * e_w**2)
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 64, 512, generator=g).bfloat16(), torch.randn(8, 512, 256, generator=g).bfloat16()
    exact = torch.bmm(x.double(), w.double())
    rel = float((get_scheme(name)(x, w).double() - exact).norm() / exact.norm())
    assert abs(rel - theory) <= 0.03 * theory, f"{name}: relative RMS error {rel:.4%}, theory {theory:.4%}"
