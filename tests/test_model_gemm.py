"""mlaq.model.gemm: bf16 GEMMs through fp32 on CPUs without native bf16.

The fp32 path must equal an independent oracle of what a bf16 GEMM with fp32 accumulation computes
(exact products summed in float64, rounded to fp32 then to bf16) to within one bf16 rounding, and a loaded
model must produce the same logits whichever path its linears take (the CPU probe is overridden)."""

from __future__ import annotations

import torch
from torch import nn

from mlaq.model import gemm


def test_fp32_gemm_is_a_bf16_gemm_with_fp32_accumulation():
    torch.manual_seed(0)
    x = torch.randn(64, 256).bfloat16()
    w = torch.randn(96, 256).bfloat16()
    got = gemm.fp32_gemm(x, w)
    assert got.dtype == torch.bfloat16
    exact = (x.double() @ w.double().T).float()  # products of bf16 are exact; float64 sums
    want = exact.bfloat16()
    # at most one bf16 ulp apart (the fp32 sum's order), and equal for nearly every element
    ulp = torch.ldexp(torch.ones_like(exact), torch.frexp(exact).exponent - 8)
    assert ((got.float() - want.float()).abs() <= ulp).all()
    assert (got == want).float().mean() > 0.98


def test_linear_takes_the_fp32_path_only_for_bf16_gemms_without_native_bf16(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "fp32_gemm", lambda x, w, b=None: calls.append(x.shape) or torch.zeros(1))
    w = torch.randn(16, 32).bfloat16()
    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: False)
    gemm.linear(torch.randn(1, 32).bfloat16(), w)  # a GEMV: native
    gemm.linear(torch.randn(8, 32), w.float())  # fp32: native
    gemm.linear(torch.randn(2, 4, 32).bfloat16(), w)  # 8 rows: fp32 path
    assert calls == [torch.Size([2, 4, 32])]
    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: True)
    gemm.linear(torch.randn(64, 32).bfloat16(), w)
    assert len(calls) == 1


def test_use_gemm_linears_keeps_parameters_and_outputs(monkeypatch):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(32, 48, bias=True), nn.ReLU(), nn.Linear(48, 8, bias=False)).bfloat16()
    x = torch.randn(16, 32).bfloat16()
    names = [n for n, _ in net.named_parameters()]
    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: False)
    assert gemm.use_gemm_linears(net) == 2
    assert [n for n, _ in net.named_parameters()] == names
    h = gemm.fp32_gemm(x, net[0].weight, net[0].bias).relu()
    assert torch.equal(net(x), gemm.fp32_gemm(h, net[2].weight))


def test_bundled_model_logits_agree_across_paths(monkeypatch):
    """The bundled model in bf16: native path vs fp32 GEMMs differ only by bf16 rounding noise."""
    from mlaq.model import ModelCache, load_model
    from mlaq.validate.config import bundled_model_dir

    model = load_model(bundled_model_dir(), dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 48))
    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: True)
    with torch.no_grad():
        native = model.prefill(ids, ModelCache()).logits.float()
    monkeypatch.setattr(gemm, "cpu_has_native_bf16", lambda: False)
    with torch.no_grad():
        upcast = model.prefill(ids, ModelCache()).logits.float()
    rel = (native - upcast).norm() / native.norm()
    assert 0 < rel < 0.02, rel
