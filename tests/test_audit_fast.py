"""mlaq.audit.measure (the in-place figures the audit computes) pinned bit for bit to mlaq.audit.stats
(the plain formulation: each scheme's ``prepare``, then the statistics), on random tensors with real
head dimensions and on the real-layout test checkpoints, bf16 and block FP8."""

from __future__ import annotations

import shutil
from contextlib import contextmanager

import pytest
import torch
from safetensors import safe_open

from audit_helpers import bf16_checkpoint, header_spans
from mlaq.audit import audit
from mlaq.audit.measure import Workspace, exact_into, fp8_into, measure, round_magnitudes_, scheme_figures
from mlaq.audit.stats import Reference, scheme_error, weight_stats
from mlaq.bmm import get_scheme, split_kv_b_proj, split_kv_b_proj_fp8
from mlaq.formats import Fp8Dtype, e2m1_round, fp8_cast, quantize_fp8
from mlaq.formats.fp8 import fp8_has_nan
from mlaq.model.loading.weights import CheckpointWeight, WeightFormat
from mlaq.settings import Settings
from quant_helpers import quantize_checkpoint

FAST = ("fp8_per_tensor", "fp8_per_head", "fp8_per_channel", "fp8_per_block", "fp8_per_tensor_fnuz")
FAST += ("mxfp4", "mxfp4_w4a16", "mxfp8")
SCHEMES = (*FAST, "bf16", "fp32")  # the last two: no fast path, prepare() into the same statistics


@contextmanager
def threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def kv_b_like(n: int, k: int, m: int, seed: int) -> torch.Tensor:
    """(N, K, M) with per-head scales, heavy-tailed columns, exact zeros, an all-zero MX block and values
    small enough to flush: every branch of the figures."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, m, generator=g) * torch.exp(0.5 * torch.randn(n, 1, 1, generator=g)) * 0.05
    w[:, :, torch.randint(0, m, (3,), generator=g)] *= 12.0
    w[torch.rand(n, k, m, generator=g) < 0.01] = 0.0
    w[0, :32, 0] = 0.0  # one all-zero block along K
    w[1, 32:64, 1] *= 1e-6  # a block of tiny values beside ...
    w[1, 40, 1] = 3.0  # ... one large one: most of them flush
    return w.contiguous()


def spec(w: torch.Tensor, scheme: str, mx_block: int | None = 32):
    ref = Reference.of(w, mx_block)
    return weight_stats(w), scheme_error(ref, get_scheme(scheme).prepare(w), scheme)


def fast(w: torch.Tensor, scheme: str, *, bf16_exact: bool, mx_block: int | None = 32):
    ref = measure(w.clone(), Workspace(), bf16_exact=bf16_exact, mx_block=mx_block)
    return ref.stats, scheme_figures(ref, get_scheme(scheme))


@pytest.mark.parametrize("shape", [(4, 128, 512), (4, 512, 128)])  # W_UK, W_UV^T with DeepSeek-V3's P, L, V
def test_random_bf16_weights(shape):
    w = kv_b_like(*shape, seed=shape[1]).to(torch.bfloat16).float()
    with threads(1):  # as the audit runs
        for scheme in SCHEMES:
            want, got = spec(w, scheme), fast(w, scheme, bf16_exact=True)
            assert got == want, scheme
    error = want[1]  # fp32: exact
    assert error.rel_rms == 0.0 and error.max_abs == 0.0


def test_same_figures_at_two_threads():
    """Same torch operations on the same values: equal at any thread count (the audit uses one)."""
    w = kv_b_like(4, 128, 512, seed=3).to(torch.bfloat16).float()
    with threads(2):
        for scheme in ("mxfp4", "fp8_per_tensor"):
            assert fast(w, scheme, bf16_exact=True) == spec(w, scheme), scheme


def test_mx_figures_are_exercised():
    """The data above reaches every MX branch: flushed and saturated blocks, both nonzero."""
    w = kv_b_like(4, 128, 512, seed=128).to(torch.bfloat16).float()
    stats, e = fast(w, "mxfp4", bf16_exact=True)
    assert 0 < e.mx_flush_blocks < 1 and 0 < e.mx_saturate_blocks < 1 and e.flushed > 0
    assert stats.kurtosis > 1 and stats.head_amax_spread > 1.5
    _, e8 = fast(w, "mxfp8", bf16_exact=True)
    assert e8.mx_flush_blocks > 0 and e8.rel_rms < e.rel_rms


def test_weights_not_exact_in_bf16():
    """An FP8 checkpoint's exact value (code x fp32 scale) is rounded to bf16 before the schemes see it."""
    w = kv_b_like(4, 128, 512, seed=5)
    q = quantize_fp8(w, Fp8Dtype.E4M3FN, (1, 128, 128))
    w = (q.codes.float() * q.expanded_scale()).contiguous()
    assert not torch.equal(w, w.to(torch.bfloat16).float())
    with threads(1):
        for scheme in SCHEMES:
            assert fast(w, scheme, bf16_exact=False) == spec(w, scheme), scheme


def test_ragged_k_and_no_mx_block():
    w = kv_b_like(2, 48, 64, seed=7).to(torch.bfloat16).float()  # K = 48: a ragged MX block
    for scheme in ("mxfp4", "fp8_per_tensor"):
        assert fast(w, scheme, bf16_exact=True) == spec(w, scheme)
        assert fast(w, scheme, bf16_exact=True, mx_block=None) == spec(w, scheme, None)


def test_checkpoint_data_as_prepared():
    """A scheme that runs the checkpoint's own codes: its prepared weight goes into the same figures."""
    n, p, v, lora = 2, 128, 128, 256
    kv_b = kv_b_like(n, p + v, lora, seed=9).reshape(n * (p + v), lora)
    q = quantize_fp8(kv_b, Fp8Dtype.E4M3FN, (128, 128))
    exact = (q.codes.float() * q.expanded_scale()).contiguous()
    block = get_scheme("fp8_per_block")
    mx = get_scheme("mxfp4")
    for half, (codes, scale) in zip(
        split_kv_b_proj(exact, n, p, v), split_kv_b_proj_fp8(q, n, p, v), strict=True
    ):
        w = half.contiguous()
        ref = measure(w.clone(), Workspace(), bf16_exact=False)
        for prepared, name in (
            (block.prepare_quantized(codes, scale), "fp8_per_block"),
            (mx.prepare(w), "mxfp4"),
        ):
            got = scheme_figures(ref, get_scheme(name), prepared)
            assert got == scheme_error(Reference.of(w, 32), prepared, name), name
        assert scheme_figures(ref, block, block.prepare_quantized(codes, scale)).rel_rms == 0.0


def _bf16_values(lo: float, hi: float) -> torch.Tensor:
    """Every bf16 value in [lo, hi] (all 2^16 bit patterns, filtered), as fp32."""
    v = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return v[(v >= lo) & (v <= hi)]


def test_round_magnitudes_is_e2m1_and_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    # exhaustive on bf16 magnitudes (the audit rounds |bf16| * 2^-u), plus random fp32 and every midpoint
    rand = torch.randint(0, 0x40E00000, (200_000,), generator=g, dtype=torch.int32).view(torch.float32)
    for elem_max, mbits, emin, reference in (
        (6.0, 1, 0, e2m1_round),
        (448.0, 3, -6, lambda a: fp8_cast(a, Fp8Dtype.E4M3FN).float()),
    ):
        grid = reference(_bf16_values(0, elem_max)).unique()
        mids = (grid[1:] + grid[:-1]) / 2
        a = torch.cat([_bf16_values(0, 1e38), rand.abs() * (elem_max / 7), mids]).clamp(max=elem_max)
        got = round_magnitudes_(a.clone(), mbits, emin, torch.empty_like(a))
        assert torch.equal(got, reference(a)), (elem_max, a[got != reference(a)][:5])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_into_decodes_every_code(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    codes = codes[~torch.isnan(codes.float())]
    out = fp8_into(torch.empty(codes.shape), codes, torch.empty(codes.shape))
    want = codes.float()
    assert torch.equal(out, want) and torch.equal(out.signbit(), want.signbit())


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2])
def test_fp8_has_nan_reads_the_bytes(dtype):
    for byte in range(256):
        codes = torch.tensor([0, byte, 0], dtype=torch.uint8).view(dtype)
        assert fp8_has_nan(codes) == bool(torch.isnan(codes.float()).any()), (dtype, byte)


@pytest.mark.parametrize(
    "fmt, block, scale_shape",
    [
        (WeightFormat.FP8_BLOCK, (128, 128), (3, 2)),
        (WeightFormat.FP8_BLOCK, (128, 128), (3, 3)),  # ragged: 300 x 260
        (WeightFormat.FP8_PER_TENSOR, None, (1,)),
        (WeightFormat.FP8_PER_CHANNEL, None, (384, 1)),
    ],
)
def test_exact_into_is_dequantize(fmt, block, scale_shape):
    rows, cols = (300, 260) if scale_shape == (3, 3) else (384, 256)
    g = torch.Generator().manual_seed(1)
    codes = (torch.randn(rows, cols, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=g) * 1e-3
    stored = CheckpointWeight("m", fmt, codes, scale, block)
    assert torch.equal(exact_into(stored, Workspace()), stored.dequantize())
    dense = CheckpointWeight("m", WeightFormat.DENSE, codes.float().to(torch.bfloat16))
    assert torch.equal(exact_into(dense, Workspace()), dense.dequantize())


# --- the audit end to end on the real-layout checkpoints, against stats on the kv_b_proj it read ---

N, P, V = 2, 128, 128


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    bf16 = bf16_checkpoint(tmp_path_factory.mktemp("fast") / "bf16")
    fp8 = tmp_path_factory.mktemp("fast") / "fp8"
    shutil.copytree(bf16, fp8)
    quantize_checkpoint(fp8, "fp8")
    return bf16, fp8


def _stored(path, layer: int):
    module = f"model.layers.{layer}.self_attn.kv_b_proj"
    spans = header_spans(path)
    with safe_open(str(spans[f"{module}.weight"][0]), "pt") as f:
        codes = f.get_tensor(f"{module}.weight")
        if codes.dtype != torch.float8_e4m3fn:
            return CheckpointWeight(module, WeightFormat.DENSE, codes)
    with safe_open(str(spans[f"{module}.weight_scale_inv"][0]), "pt") as f:
        scale = f.get_tensor(f"{module}.weight_scale_inv")
    return CheckpointWeight(module, WeightFormat.FP8_BLOCK, codes, scale, (128, 128))


@pytest.mark.parametrize("which", ["bf16", "fp8"])
def test_audit_figures_are_the_spec(ckpts, which):
    path = ckpts[0] if which == "bf16" else ckpts[1]
    schemes = ("mxfp4", "fp8_per_tensor", "fp8_per_block")
    record = audit(path, schemes, Settings(fp8bmm=False, fp4bmm=False), workers=2)
    with threads(1):  # as the audit runs its layers
        for layer in record["layers"]:
            stored = _stored(path, layer["layer"])
            halves = [t.contiguous() for t in split_kv_b_proj(stored.dequantize(), N, P, V)]
            own = split_kv_b_proj_fp8(stored.fp8(), N, P, V) if which == "fp8" else None
            for h, (key, w) in enumerate(zip(("w_uk", "w_uv"), halves, strict=True)):
                assert layer[key] == weight_stats(w).to_json()
                ref = Reference.of(w, 32)
                for s in schemes:
                    scheme = get_scheme(s)
                    runs_stored = own is not None and s == "fp8_per_block"
                    prepared = scheme.prepare_quantized(*own[h]) if runs_stored else scheme.prepare(w)  # type: ignore[attr-defined,index]
                    assert layer["schemes"][s]["uses_checkpoint_data"] == runs_stored
                    assert layer["schemes"][s][key] == scheme_error(ref, prepared, s).to_json(), (s, key)
