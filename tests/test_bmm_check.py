"""check_kernel: passes faithful kernels, flags the real bug classes (packed-K masking, wrong scale rule)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mlaq.bmm import KernelShape, check_kernel, get_scheme, scheme_names
from mlaq.bmm.base import PreparedWeight
from mlaq.bmm.fp8_quant import aiter_token_group_quant

E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _np_mxfp4_act(x: np.ndarray, floor_rule: bool = False) -> np.ndarray:
    """Per token per 32 along K, MXFP4. EVEN rounds amax to 1 mantissa bit (ties up) before the floor:
    the exponent goes up by one when amax >= 1.75 * 2^floor(log2 amax)."""
    out = np.zeros_like(x)
    for k0 in range(0, x.shape[-1], 32):
        xb = x[..., k0 : k0 + 32]
        a = np.abs(xb).max(axis=-1, keepdims=True)
        m, e = np.frexp(a)  # a = m * 2^e, m in [0.5, 1): floor(log2 a) = e - 1
        carry = 0 if floor_rule else (m >= 0.875)
        u = np.where(a > 0, e - 1 + carry - 2, -127).astype(np.float64)  # emax(E2M1) = 2
        q = np.clip(xb / 2.0**u, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
        out[..., k0 : k0 + 32] = q * 2.0**u
    return out


def independent_mxfp4_kernel(x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
    """Reads the packed E2M1 nibbles and E8M0 bytes, quantizes activations itself, accumulates in
    numpy float32 (its own order), rounds to bf16."""
    mx = prepared.mx
    packed = mx.packed().numpy()  # (N, ceil(K/2), M), element 2i in the low nibble
    codes = np.stack([packed & 0x0F, packed >> 4], axis=2).reshape(packed.shape[0], -1, packed.shape[2])
    k = x.shape[2]
    w = (
        E2M1_VALUES[codes[:, :k]]
        * np.repeat(2.0 ** (mx.scales.numpy().astype(np.float64) - 127), 32, axis=1)[:, :k]
    )
    xq = _np_mxfp4_act(x.float().numpy())
    y = np.matmul(xq.astype(np.float32), w.astype(np.float32))
    return torch.from_numpy(y.astype(ml_dtypes.bfloat16).astype(np.float32))


def packed_k_mask_kernel(x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
    """The GLM-5.2 bug: bf16 activations masked with the PACKED K (K/2): elements K/2.. read as 0."""
    x = x.clone()
    x[:, :, x.shape[2] // 2 :] = 0
    return get_scheme("mxfp4").apply(x, prepared)


def floor_rule_kernel(x: torch.Tensor, prepared: PreparedWeight) -> torch.Tensor:
    """Activation scales by the OCP FLOOR rule instead of AMD's EVEN."""
    xq = _np_mxfp4_act(x.float().numpy(), floor_rule=True)
    y = torch.bmm(torch.from_numpy(xq).double(), prepared.dequantize(torch.float64)).float()
    return y.bfloat16().float()


@pytest.mark.parametrize("name", scheme_names())
def test_emulation_passes_itself(name):
    scheme = get_scheme(name)
    report = check_kernel(scheme.apply, scheme)
    assert report.passed, report.format()
    assert all(c.max_ulps == 0 for c in report.checks)


def test_independent_mxfp4_kernel_passes():
    report = check_kernel(independent_mxfp4_kernel, "mxfp4")
    assert report.passed, report.format()
    assert max(c.max_ulps for c in report.checks) <= 1  # fp32 order differences: at most one bf16 ulp


def test_packed_k_masking_is_flagged():
    report = check_kernel(packed_k_mask_kernel, "mxfp4")
    assert not report.passed
    glm = [c for c in report.checks if c.shape.k == 192]
    assert glm and all(not c.passed and c.flagged > 0.9 * c.total for c in glm)
    assert all(not c.passed for c in report.checks)  # any K: half the reduction is gone
    text = report.format()
    assert "FAIL" in text and "DEPARTS" in text and "K=P=192" in text


def test_wrong_scale_rule_is_flagged():
    report = check_kernel(floor_rule_kernel, "mxfp4")
    assert not report.passed
    assert sum(not c.passed for c in report.checks) >= len(report.checks) - 2, report.format()
    assert [c for c in report.checks if c.shape.k == 192 and not c.passed]


def test_fp8_whole_row_activation_scale_is_flagged():
    """An FP8 kernel that takes one activation scale per token over all of K (not per 128)."""
    scheme = get_scheme("fp8_per_tensor")

    def _whole_row(x, prepared):
        xq, xs = aiter_token_group_quant(x, scheme.dtype, group=x.shape[2])  # one group per token
        return (
            torch.bmm(xq.double() * xs.double(), prepared.dequantize(torch.float64))
            .float()
            .bfloat16()
            .float()
        )

    report = check_kernel(_whole_row, scheme, shapes=[(4, 3, 192, 64), (2, 3, 512, 32), (4, 3, 100, 16)])
    assert [c.passed for c in report.checks] == [False, False, True]  # K <= 128 is one group anyway


def test_kernel_errors_and_wrong_shapes_are_reported():
    def raises(x, prepared):
        raise RuntimeError("K must be a multiple of 32")

    report = check_kernel(raises, "bf16", shapes=[KernelShape(2, 2, 80, 8, "ragged")])
    assert not report.passed and "multiple of 32" in report.checks[0].error
    report = check_kernel(lambda x, p: torch.zeros(1), "bf16", shapes=[(2, 2, 64, 8)])
    assert "expected (2, 2, 8)" in report.checks[0].error
    with pytest.raises(ValueError, match="dimension < 1"):
        check_kernel(lambda x, p: x, "bf16", shapes=[(0, 1, 8, 8)])
