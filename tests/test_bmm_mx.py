"""MX BMM schemes against an independent numpy/ml_dtypes formulation (own scale rules, per element)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.bmm import get_scheme

ELEM = {"e2m1": (ml_dtypes.float4_e2m1fn, 6.0, 2, 1), "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, 8, 3)}


def oracle_mx(x: np.ndarray, elem: str, rule: str) -> np.ndarray:
    """Blocks of 32 along the last axis (ragged tail), E8M0 scale by ``rule``, RNE saturating elements;
    returns the dequantized values in float64."""
    np_dtype, emax_val, emax, mbits = ELEM[elem]
    out = np.zeros(x.shape)
    for k0 in range(0, x.shape[-1], 32):
        xb = x[..., k0 : k0 + 32].astype(np.float32)
        a = np.abs(xb).max(axis=-1, keepdims=True).astype(np.float32)
        if rule == "even":  # round amax to mbits mantissa bits (carry may bump the exponent), then floor
            bits = a.view(np.uint32).astype(np.int64) + (1 << (22 - mbits))
            u = ((bits >> 23) & 0xFF) - 127 - emax
        else:  # rceil: smallest u with max * 2^u >= amax
            u = np.ceil(np.log2(np.where(a > 0, a, 1) / emax_val))
            u = np.where(emax_val * 2.0 ** (u - 1) >= a, u - 1, u)
            u = np.where(emax_val * 2.0**u < a, u + 1, u)
        u = np.where(a == 0, -127, np.clip(u, -127, 127)).astype(np.float64)
        y = np.clip(xb / 2.0**u, -emax_val, emax_val)
        out[..., k0 : k0 + 32] = y.astype(np_dtype).astype(np.float64) * 2.0**u
    return out


def _data(n, b, k, m, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, b, k, generator=g) * torch.exp(torch.randn(n, b, 1, generator=g))).bfloat16()
    w = torch.randn(n, k, m, generator=g).bfloat16().float()
    w[0, :7, 0] = torch.tensor([1.5, 1.75, 3.0, 6.0, 0.75, 2.5, 1.4921875])  # EVEN rounds some amax up
    return x, w


@pytest.mark.parametrize(
    ("name", "w_rule", "act"),
    [
        ("mxfp4", ("e2m1", "even"), ("e2m1", "even")),
        ("mxfp4_w4a16", ("e2m1", "even"), None),
        ("mxfp8", ("e4m3", "rceil"), ("e4m3", "rceil")),
    ],
)
@pytest.mark.parametrize("k", [192, 80, 16])
def test_mx_schemes_match_oracle(name, w_rule, act, k):
    x, w = _data(3, 7, k, 24, seed=k)
    scheme = get_scheme(name)
    prepared = scheme.prepare(w)
    w_deq = np.swapaxes(oracle_mx(np.swapaxes(w.numpy(), 1, 2), *w_rule), 1, 2)  # blocks along K
    np.testing.assert_array_equal(prepared.dequantize(torch.float64).numpy(), w_deq)
    xf = x.float().numpy()
    x_deq = oracle_mx(xf, *act) if act else xf.astype(np.float64)
    np.testing.assert_array_equal(scheme.activation_values(x).numpy(), x_deq)
    want = (
        np.einsum("nbk,nkm->nbm", x_deq, w_deq)
        .astype(np.float32)
        .astype(ml_dtypes.bfloat16)
        .astype(np.float32)
    )
    got = scheme.apply(x, prepared).numpy()
    ulp = np.spacing(np.abs(want).astype(ml_dtypes.bfloat16)).astype(np.float32)
    assert np.all(np.abs(got - want) <= ulp)
    assert np.mean(got == want) > 0.99
