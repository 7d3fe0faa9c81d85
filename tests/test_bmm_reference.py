import pytest
import torch

from mlaq.bmm import get_scheme, scheme_names


def test_unknown_scheme_lists_known():
    with pytest.raises(ValueError, match=r"known schemes: .*bf16"):
        get_scheme("fp3")
    assert {"fp32", "bf16"} <= set(scheme_names())


def test_bf16_reference_rounds_operands_and_output():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 3, 64, generator=g), torch.randn(4, 64, 16, generator=g)
    y = get_scheme("bf16")(x, w)
    ref = torch.bmm(x.bfloat16().double(), w.bfloat16().double())
    assert torch.equal(y, y.bfloat16().float())  # output is bf16-representable
    assert torch.allclose(y.double(), ref, rtol=2**-8, atol=1e-6)


def test_shape_mismatch_is_clear():
    with pytest.raises(ValueError, match=r"expected \(N=4, B, K=64\)"):
        get_scheme("fp32")(torch.randn(4, 3, 32), torch.randn(4, 64, 16))


@pytest.mark.parametrize(
    ("made_by", "applied_by"),
    [("fp8_per_tensor", "mxfp4"), ("mxfp4", "fp8_per_block"), ("fp8_per_tensor", "fp8_per_block")],
)
def test_a_weight_prepared_by_another_scheme_is_refused(made_by, applied_by):
    w = get_scheme(made_by).prepare(torch.randn(2, 64, 8))
    with pytest.raises(
        ValueError, match=f"{applied_by} needs a weight prepared by {applied_by}, got {made_by}"
    ):
        get_scheme(applied_by).apply(torch.randn(2, 3, 64), w)
