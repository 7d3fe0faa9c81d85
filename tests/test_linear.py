"""mlaq.model.layers.linear: bf16 linears through the float32 GEMM where the CPU has no native bf16 GEMM."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from mlaq.model.layers import linear as lin
from mlaq.model.layers.linear import Embedding
from mlaq.validate.config import bundled_model_dir


def _operands(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 96, generator=g).to(dtype)
    w = (torch.randn(160, 96, generator=g) / 10).to(dtype)
    b = torch.randn(160, generator=g).to(dtype)
    return x, w, b


def test_upcast_gives_the_float32_gemm_rounded_once(monkeypatch):
    monkeypatch.setattr(lin, "native_low_precision_gemm", lambda: False)
    x, w, b = _operands(8, torch.bfloat16)
    assert lin.upcast_gemm(x, w)
    got = lin.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 8, 160)
    assert torch.equal(got, torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16())
    # the same arithmetic as torch's own bf16 GEMM up to the accumulation order: at most 1 ulp apart
    ref = torch.nn.functional.linear(x, w, b).float()
    assert torch.all((got.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-6)


def test_single_rows_float32_and_native_cpus_keep_f_linear(monkeypatch):
    monkeypatch.setattr(lin, "native_low_precision_gemm", lambda: False)
    x, w, _ = _operands(1, torch.bfloat16)
    assert not lin.upcast_gemm(x[:1], w)  # one row: the bf16 GEMV is as fast
    xf, wf, bf = _operands(8, torch.float32)
    assert not lin.upcast_gemm(xf, wf)
    assert torch.equal(lin.linear(xf, wf, bf), torch.nn.functional.linear(xf, wf, bf))
    monkeypatch.setattr(lin, "native_low_precision_gemm", lambda: True)
    x8, w8, _ = _operands(8, torch.bfloat16)
    assert not lin.upcast_gemm(x8, w8)
    assert torch.equal(lin.linear(x8, w8), torch.nn.functional.linear(x8, w8))


def test_linear_module_is_an_nn_linear_with_its_names(monkeypatch):
    monkeypatch.setattr(lin, "native_low_precision_gemm", lambda: False)
    m = lin.Linear(96, 160, dtype=torch.bfloat16)
    assert isinstance(m, nn.Linear) and set(m.state_dict()) == {"weight", "bias"}
    x, _, _ = _operands(8, torch.bfloat16)
    assert torch.equal(m(x), lin.linear(x, m.weight, m.bias))


def test_bundled_model_logits_agree_across_paths(monkeypatch):
    """The bundled model in bf16: the native bf16 GEMMs and the float32 path differ only by bf16 rounding."""
    from mlaq.model import ModelCache, load_model
    from mlaq.validate.config import bundled_model_dir

    model = load_model(bundled_model_dir(), dtype=torch.bfloat16)
    ids = torch.randint(0, model.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    out = {}
    for native in (True, False):
        monkeypatch.setattr(lin, "native_low_precision_gemm", lambda native=native: native)
        with torch.no_grad():
            out[native] = model.prefill(ids, ModelCache()).logits.float()
    rel = (out[True] - out[False]).norm() / out[True].norm()
    assert 0 < rel < 0.02, rel


def test_linear_traces_without_a_graph_break():
    """Under torch.compile the machine probe is a constant: no graph break at a multi-row bf16 linear
    (dynamo may not trace torch.backends; a break at every linear made compiled batched decode
    slower than eager)."""
    torch._dynamo.reset()
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(16, 8).bfloat16()
    traced = torch.compile(lin.linear, backend="eager", fullgraph=True)  # fullgraph: a break raises
    assert torch.equal(traced(x, w), lin.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fuse_rows_gives_each_layer_its_own_bits_from_one_gemm(dtype):
    """vLLM's fused_qkv_a_proj / gate_up_proj: the stacked weight's GEMM, split by columns, gives each layer's
    output bit for bit (oneDNN's kernels, 1 to 33 rows), and the layers' weights become views of it."""
    torch.manual_seed(0)
    q_a, kv_a = lin.Linear(64, 32, bias=False, dtype=dtype), lin.Linear(64, 48, bias=False, dtype=dtype)
    xs = [torch.randn(1, rows, 64, dtype=dtype) for rows in (1, 3, 8, 33)]
    apart = [(q_a(x), kv_a(x)) for x in xs]
    before = (q_a.weight.clone(), kv_a.weight.clone())
    fused = lin.fuse_rows(q_a, kv_a)
    assert fused is not None and tuple(fused.shape) == (80, 64)
    assert q_a.weight.data_ptr() == fused.data_ptr() and kv_a.weight.data_ptr() == fused[32:].data_ptr()
    assert torch.equal(q_a.weight, before[0]) and torch.equal(kv_a.weight, before[1])
    for x, (a, b) in zip(xs, apart, strict=True):
        first, second = lin.linear(x, fused).split([32, 48], dim=-1)
        assert torch.equal(first, a) and torch.equal(second, b)


def test_fuse_rows_leaves_what_it_cannot_stack():
    biased, plain = lin.Linear(16, 8, bias=True), lin.Linear(16, 8, bias=False)
    other_dtype, other_width = (
        lin.Linear(16, 8, bias=False, dtype=torch.bfloat16),
        lin.Linear(24, 8, bias=False),
    )
    for pair in ((biased, plain), (plain, other_dtype), (plain, other_width)):
        ptrs = [layer.weight.data_ptr() for layer in pair]
        assert lin.fuse_rows(*pair) is None
        assert [layer.weight.data_ptr() for layer in pair] == ptrs  # nothing changed


def test_embedding_initialises_real_tables_and_leaves_meta_ones_alone():
    torch.manual_seed(0)
    real = Embedding(16, 4)
    assert real.weight.abs().sum() > 0  # drawn as nn.Embedding draws them
    torch.manual_seed(0)
    assert torch.equal(real.weight, torch.nn.Embedding(16, 4).weight)
    assert Embedding(16, 4, device="meta").weight.is_meta


def test_loading_a_model_does_not_import_dynamo():
    """The loader builds on meta; nothing there may draw random values (torch._dynamo's import, ~1-2 s)."""
    code = (
        "import sys; from mlaq.model import load_model; "
        f"load_model({str(bundled_model_dir())!r}); print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: some CPU
flags\t\t: fpu sse2 avx2 {extra}

processor\t: 1
vendor_id\t: SomeoneElse
flags\t\t: amx_bf16
"""


def test_cpu_identity_reads_the_first_processor():
    vendor, flags = lin.cpu_identity(CPUINFO.format(vendor="GenuineIntel", extra="avx512_bf16").splitlines())
    assert vendor == "GenuineIntel"
    assert {"avx2", "avx512_bf16"} <= flags and "amx_bf16" not in flags  # processor 1's flags not read
    assert lin.cpu_identity([]) == ("", frozenset())


@pytest.mark.parametrize(
    ("onednn", "vendor", "extra", "fast"),
    [
        (True, "GenuineIntel", "avx512_bf16 amx_bf16 amx_tile", True),  # Sapphire Rapids and later
        (True, "GenuineIntel", "avx512_bf16", False),  # AMX absent or hidden: bf16 slower than float32
        (True, "AuthenticAMD", "avx512_bf16", True),  # Zen 4
        (False, "AuthenticAMD", "", False),  # Zen 3: torch's generic bf16 kernel
        (True, "", "", True),  # no /proc/cpuinfo: oneDNN's word stands
    ],
)
def test_fast_bf16_gemm_by_cpu(onednn, vendor, extra, fast):
    _, flags = lin.cpu_identity(CPUINFO.format(vendor=vendor, extra=extra).splitlines())
    assert lin.fast_bf16_gemm(onednn, vendor, flags) is fast
