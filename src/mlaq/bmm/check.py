"""Kernel conformance: run an external batched-matmul kernel against a scheme's exact emulation.

Calling convention of the kernel under test::

    fn(x, prepared) -> Tensor
      x         bf16 (N, B, K) activations, contiguous (what the engine hands the kernel)
      prepared  the scheme's PreparedWeight (codes, scales, ``dequantize()``; e.g. ``prepared.mx.packed()``
                for MXFP4) — the weight as it sits in memory after load-time quantization
      returns   (N, B, M) in any floating dtype (bf16 expected for the quantized schemes)

The kernel must do its own dynamic activation quantization, as the engine kernels do.

Tolerance, per output element: one unit in the last place of the scheme's output dtype (two
correct fp32 sums that straddle a rounding boundary round to neighbours) plus a bound on fp32
accumulation in any order, ``(K + 8) * 2**-24 * sum_k |x_k * w_k|`` over the quantized operands
(Higham's gamma_K with slack for the per-group scale multiplications). A kernel with different
arithmetic (a wrong scale rule, masked activations, a wrong group size) departs by quantization-noise
sized amounts, many ulps, and is flagged.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight

Kernel = Callable[[Tensor, PreparedWeight], Tensor]

_FP32_UNIT = 2.0**-24  # unit roundoff of fp32


@dataclass(frozen=True)
class KernelShape:
    """One case of the grid: N heads, B tokens, reduction K, output M."""

    heads: int
    batch: int
    k: int
    m: int
    why: str = ""


# Ragged K is where packed-length and tail-group bugs live: 192 = GLM-5's P (128 + 64, six MX blocks),
# 80 and 200 are multiples of neither 32 nor 128, 16 is shorter than one MX block.
DEFAULT_SHAPES: tuple[KernelShape, ...] = (
    KernelShape(4, 3, 192, 64, "GLM-5 q absorption, K=P=192 = 128+64"),
    KernelShape(4, 3, 80, 48, "K=80, not a multiple of 32"),
    KernelShape(4, 3, 200, 40, "K=200, ragged 128-group and 32-block"),
    KernelShape(2, 3, 512, 64, "V up-projection K=L=512, aligned"),
    KernelShape(3, 2, 16, 8, "K=16, shorter than one MX block"),
    KernelShape(2, 1, 192, 32, "batch 1"),
    KernelShape(2, 64, 192, 32, "batch 64"),
    KernelShape(2, 257, 192, 32, "batch 257, not a power of two"),
    KernelShape(1, 5, 128, 32, "one head"),
    KernelShape(16, 4, 80, 16, "16 heads"),
    KernelShape(128, 2, 80, 16, "128 heads (DeepSeek-V3)"),
)


@dataclass(frozen=True)
class ShapeCheck:
    """The kernel against the emulation on one shape."""

    shape: KernelShape
    max_ulps: float  # max |got - ref| in ulps of the output dtype (at max(|ref|, |got|))
    max_excess: float  # max |got - ref| / tolerance; above 1 is a departure
    flagged: int  # output elements beyond tolerance (or non-finite where the reference is finite)
    total: int
    worst: tuple[int, int, int]  # (n, b, m) of the largest excess
    worst_ref: float
    worst_got: float
    error: str | None = None  # the kernel raised or returned a wrong shape

    @property
    def passed(self) -> bool:
        return self.error is None and self.flagged == 0


@dataclass(frozen=True)
class KernelReport:
    """Per-shape results of ``check_kernel``; ``passed`` only if every shape conforms."""

    scheme: str
    kernel: str
    checks: tuple[ShapeCheck, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> tuple[ShapeCheck, ...]:
        return tuple(c for c in self.checks if not c.passed)

    def format(self) -> str:
        """An aligned plain-text table, one row per shape."""
        head = f"{'N':>4} {'B':>4} {'K':>4} {'M':>4} {'max ulps':>10} {'max/tol':>9} {'flagged':>13}  verdict"
        lines = [f"kernel {self.kernel} vs {self.scheme}: {'PASS' if self.passed else 'FAIL'}", head]
        for c in self.checks:
            s = c.shape
            if c.error is not None:
                lines.append(f"{s.heads:>4} {s.batch:>4} {s.k:>4} {s.m:>4}  ERROR {c.error}")
                continue
            verdict = (
                "ok" if c.passed else f"DEPARTS at {c.worst}: ref {c.worst_ref:.6g} got {c.worst_got:.6g}"
            )
            lines.append(
                f"{s.heads:>4} {s.batch:>4} {s.k:>4} {s.m:>4} {c.max_ulps:>10.3g} {c.max_excess:>9.3g} "
                f"{c.flagged:>6}/{c.total:<6}  {verdict}  ({s.why})"
            )
        if not self.passed and self.scheme == "fp8_per_block":
            lines.append(
                "note: a kernel on NVIDIA Hopper FP8 tensor cores (DeepGEMM, cuBLASLt, Triton tl.dot) keeps 13 "
                "fraction bits of each sum and departs from exact sums by up to ~2^-11 of sum |x w|; check "
                "such a kernel against fp8_per_block_sm90, which models those sums bit for bit"
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _ulp(values: Tensor, dtype: torch.dtype) -> Tensor:
    """Spacing of ``dtype`` at |values| (float64), floored at the dtype's smallest subnormal."""
    info = torch.finfo(dtype)
    mant_bits = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    exp = torch.floor(torch.log2(values.abs().clamp_min(info.tiny)))
    return torch.exp2(exp - mant_bits).clamp_min(info.smallest_normal * info.eps)


def _case_data(shape: KernelShape, seed: int) -> tuple[Tensor, Tensor]:
    """Activations with per-token spread and a weight with per-head spread and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    n, b, k, m = shape.heads, shape.batch, shape.k, shape.m
    token_gain = torch.exp(torch.randn(n, b, 1, generator=g))  # tokens differ in scale: per-token quant
    x = (torch.randn(n, b, k, generator=g) * token_gain).to(torch.bfloat16)
    head_gain = torch.exp(0.5 * torch.randn(n, 1, 1, generator=g))
    w = torch.randn(n, k, m, generator=g) * head_gain * 0.05
    outliers = torch.rand(n, k, m, generator=g) < 0.002
    w = torch.where(outliers, w * 20, w)
    return x, w.to(torch.bfloat16).float()


def _check_one(fn: Kernel, scheme: BmmScheme, shape: KernelShape, seed: int) -> ShapeCheck:
    x, w = _case_data(shape, seed)
    prepared = scheme.prepare(w)
    ref = scheme.apply(x, prepared).double()  # (N, B, M)
    try:
        got = fn(x.clone(), prepared)
    except Exception as exc:  # a kernel that cannot run a shape is a finding, not a crash of the checker
        return ShapeCheck(shape, math.inf, math.inf, ref.numel(), ref.numel(), (0, 0, 0), 0.0, 0.0, repr(exc))
    if not isinstance(got, Tensor) or tuple(got.shape) != tuple(ref.shape):
        found = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
        error = f"returned {found}, expected {tuple(ref.shape)}"
        return ShapeCheck(shape, math.inf, math.inf, ref.numel(), ref.numel(), (0, 0, 0), 0.0, 0.0, error)
    got = got.detach().double()
    xa = scheme.activation_values(x).abs()  # (N, B, K) quantized activations
    wa = prepared.dequantize(torch.float64).abs()  # (N, K, M)
    acc_bound = (shape.k + 8) * _FP32_UNIT * torch.bmm(xa, wa)  # (N, B, M)
    # ulp at the larger of the two: a correct kernel may round to the neighbour across a binade edge
    ulp = _ulp(torch.maximum(ref.abs(), got.abs().nan_to_num(0.0)), scheme.out_dtype)
    dev = (got - ref).abs()
    excess = (dev / (ulp + acc_bound)).nan_to_num(nan=math.inf)  # NaN out of a kernel is a departure
    flat = int(torch.argmax(excess))
    worst = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), excess.shape))
    return ShapeCheck(
        shape=shape,
        max_ulps=float((dev / ulp).nan_to_num(nan=math.inf).max()),
        max_excess=float(excess.max()),
        flagged=int((excess > 1).sum()),
        total=excess.numel(),
        worst=worst,  # type: ignore[arg-type]
        worst_ref=float(ref[worst]),
        worst_got=float(got[worst]),
    )


def check_kernel(
    fn: Kernel,
    scheme: BmmScheme | str,
    shapes: Iterable[KernelShape | tuple[int, int, int, int]] | None = None,
    seed: int = 0,
) -> KernelReport:
    """Run ``fn(x, prepared)`` over a grid of shapes against ``scheme``'s exact emulation.

    ``shapes`` defaults to ``DEFAULT_SHAPES`` (ragged K, batch 1..257, 1..128 heads); plain
    (N, B, K, M) tuples are accepted. Every shape gets its own data from ``seed``.

    >>> from mlaq.bmm import get_scheme
    >>> s = get_scheme("bf16")
    >>> check_kernel(s.apply, s).passed
    True
    """
    if isinstance(scheme, str):
        from mlaq.bmm.registry import get_scheme

        scheme = get_scheme(scheme)
    cases = tuple(s if isinstance(s, KernelShape) else KernelShape(*s) for s in (shapes or DEFAULT_SHAPES))
    for c in cases:
        if min(c.heads, c.batch, c.k, c.m) < 1:
            raise ValueError(f"shape {c} has a dimension < 1; every one of N, B, K, M must be >= 1")
    checks = tuple(_check_one(fn, scheme, c, seed + i) for i, c in enumerate(cases))
    return KernelReport(scheme.name, getattr(fn, "__name__", type(fn).__name__), checks)
