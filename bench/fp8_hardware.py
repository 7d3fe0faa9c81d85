"""mlaq's FP8 emulation against real FP8 hardware (an NVIDIA GPU of compute capability >= 8.9).

    python bench/fp8_hardware.py --out fp8_hardware.json     # on a machine with CUDA and Triton

What it measures, each against the emulation mlaq runs on the CPU:
1. the cast: ``mlaq.formats.fp8_cast`` (fp32 -> e4m3fn, saturating RNE) against the GPU's own conversion
   instruction (Triton's fp32 -> fp8e4nv, ``cvt.rn.satfinite.e4m3x2.f32``), over every bf16 value, the
   midpoints between neighbouring e4m3 values with their fp32 neighbours, and random fp32;
2. one K-group's code dot product: mlaq's exact sum rounded once to fp32 against cuBLASLt's FP8 GEMM
   (``torch._scaled_mm``, unit scales, fp32 out, with and without ``use_fast_accum``);
3. the whole BMM of fp8_per_tensor (the AITER kernel's loop: ``acc += dot(a_g, b_g) * a_scale_g``, then
   ``acc *= w_scale``, bf16 out) and fp8_per_block (DeepGEMM's: ``acc += dot * (a_scale * b_scale)``)
   against the same loop written as a Triton kernel on the tensor cores, with the compiler's fusion of
   multiply and add into one FMA on (Triton's default) and off, against mlaq's loop with an FMA, and
   (fp8_per_block) against ``fp8_per_block_sm90``, mlaq's model of Hopper's tensor-core sums.
``--dump PATH`` also saves dot products and whole fp8_per_block BMMs with the GPU's outputs (safetensors):
tests/fixtures/h200_fp8_dots.safetensors is such a file, from an H200.

Shapes are MLA's: W_UK (K = qk_nope 128 -> M = kv_lora 512), W_UV (512 -> v 128), GLM-5's W_UK (K = 192,
a ragged last group). With no CUDA it runs parts 1-2 on the CPU's ``_scaled_mm`` as a dry run.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from gpu_report import finish, header, run_sections

from mlaq.bmm import get_scheme
from mlaq.bmm.fp8_quant import FP8_GROUP, aiter_token_group_quant, deepseek_token_group_quant
from mlaq.formats import Fp8Dtype, fp8_cast

try:  # the GPU side (Triton kernels, --dump) exists only where Triton does; parts 1 and 3 need it
    from fp8_hardware_gpu import _cast_kernel, _triton_bmm, dump, triton
except ImportError:
    triton = None

SHAPES = {"W_UK": (128, 512), "W_UV": (512, 128), "GLM-5 W_UK": (192, 512)}  # (K, M)
HEADS, TOKENS = 16, 64


def cast_inputs() -> torch.Tensor:
    """Every bf16 value, each e4m3fn midpoint with its fp32 neighbours, and 4 M random fp32."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].unique()
    mids = (codes[1:] + codes[:-1]) / 2  # exact in fp32
    near = torch.cat(
        [mids, torch.nextafter(mids, torch.tensor(-1e9)), torch.nextafter(mids, torch.tensor(1e9))]
    )
    g = torch.Generator().manual_seed(0)
    rand = torch.cat([torch.randn(2**21, generator=g) * 100, torch.randn(2**21, generator=g) * 2**-7])
    return torch.cat([every_bf16, near, rand])


def part_cast(device: str) -> dict:
    if triton is None or device != "cuda":
        return {"skipped": "needs CUDA and Triton"}
    x = cast_inputs()
    want = fp8_cast(x, Fp8Dtype.E4M3FN).view(torch.uint8)
    out = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device="cuda")
    _cast_kernel[(triton.cdiv(x.numel(), 1024),)](x.cuda(), out, x.numel(), BLOCK=1024)
    got = out.cpu().view(torch.uint8)
    nan = torch.isnan(x)
    big = x.abs() > 448
    diff = got != want
    return {
        "values": x.numel(),
        "mismatches_in_range": int((diff & ~nan & ~big).sum()),
        "mismatches_beyond_448": int((diff & big & ~nan).sum()),
        "beyond_448": int((big & ~nan).sum()),
        "nan_inputs_giving_nan": int(((got & 0x7F) == 0x7F)[nan].sum()),
        "nan_inputs": int(nan.sum()),
    }


def _dot_error(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|got - exact| / sum |a_i b_i| per output, in units of 2^-24 (fp32's unit roundoff): the error of a
    dot product relative to the size of its terms, which cancellation cannot inflate."""
    exact = a.double() @ b.double()
    terms = a.double().abs() @ b.double().abs()
    return (got.double() - exact).abs() / terms.clamp(min=1e-300) * 2**24


def part_dot(device: str, k: int, m: int) -> dict:
    g = torch.Generator().manual_seed(k * 1000 + m)
    x = torch.randn(HEADS, TOKENS, k, generator=g).bfloat16()
    w = torch.randn(HEADS, k, m, generator=g) * 0.05
    prepared = get_scheme("fp8_per_tensor").prepare(w)
    xq, _ = aiter_token_group_quant(x, Fp8Dtype.E4M3FN)
    one = torch.tensor(1.0, device=device)
    res: dict = {}
    for fast in (False, True):
        eq = total = 0
        errors = []
        for n, k0 in itertools.product(range(HEADS), range(0, k, FP8_GROUP)):
            k1 = min(k0 + FP8_GROUP, k)
            want = torch.mm(xq[n, :, k0:k1].double(), prepared.values[n, k0:k1].double()).float()
            a = xq[n, :, k0:k1].to(torch.float8_e4m3fn).to(device)
            b = prepared.codes[n, k0:k1].t().contiguous().to(device).t()  # column-major, as cuBLASLt wants
            got = torch._scaled_mm(a, b, one, one, out_dtype=torch.float32, use_fast_accum=fast).cpu()
            eq += int((got == want).sum())
            total += want.numel()
            errors.append(_dot_error(got, xq[n, :, k0:k1], prepared.values[n, k0:k1]).flatten())
        err = torch.cat(errors)
        res[f"scaled_mm{'_fast_accum' if fast else ''}"] = {
            "equal": eq,
            "of": total,
            "error_in_2^-24_of_sum_abs_terms": {
                "median": float(err.median()),
                "p99": float(err.quantile(0.99)),
                "max": float(err.max()),
            },
        }
    # mlaq's own exact-then-round-once, through the same metric: at most 0.5 by construction
    err = _dot_error(torch.bmm(xq.double(), prepared.values).float(), xq, prepared.values)
    res["mlaq_max"] = float(err.max())
    return res


def _fma_loop(xq, xs, w, per_block: bool) -> torch.Tensor:
    """mlaq's loop with ``acc = fma(dot, scale, acc)``: product and sum exact in float64, one rounding
    (a float64 sum can itself round first: rare and reported as such)."""
    n, b, k = xq.shape
    acc = torch.zeros(n, b, w.shape[2])
    for gi, k0 in enumerate(range(0, k, FP8_GROUP)):
        k1 = min(k0 + FP8_GROUP, k)
        dot = torch.bmm(xq[:, :, k0:k1].double(), w.values[:, k0:k1]).float()
        scale = xs[:, :, gi : gi + 1] * (w.scale[:, gi : gi + 1, :] if per_block else 1.0)
        acc = (acc.double() + dot.double() * scale.double()).float()
    if not per_block:
        acc = acc * w.scale
    return acc.to(torch.bfloat16).float()


def part_bmm(device: str, name: str, k: int, m: int) -> dict:
    if triton is None or device != "cuda":
        return {"skipped": "needs CUDA and Triton"}
    per_block = name == "fp8_per_block"
    g = torch.Generator().manual_seed(k + m)
    x = torch.randn(HEADS, TOKENS, k, generator=g).bfloat16()
    w = torch.randn(HEADS, k, m, generator=g) * 0.05
    scheme = get_scheme(name)
    prepared = scheme.prepare(w)
    emulated = scheme.apply(x, prepared)
    quant = deepseek_token_group_quant if per_block else aiter_token_group_quant
    xq, xs = quant(x, Fp8Dtype.E4M3FN)
    refs = {"mlaq": emulated, "mlaq_with_fma": _fma_loop(xq, xs, prepared, per_block)}
    if per_block:
        sm90 = get_scheme("fp8_per_block_sm90")
        refs["mlaq_sm90"] = sm90.apply(x, sm90.prepare(w))
    exact = torch.bmm(x.float().double(), w.double())
    quant_err = (emulated.double() - exact).norm()
    res: dict = {"scheme_rel_error_vs_fp64": float(quant_err / exact.norm())}
    variants = [
        ("triton_default", True, 0),
        ("triton_no_fp_fusion", False, 0),
        ("triton_imprecise_32", True, 32),
    ]
    for label, fusion, imprecise in variants:
        got = _triton_bmm(x, name, prepared, fusion, imprecise)
        entry = {}
        for ref_name, ref in refs.items():
            entry[f"equal_to_{ref_name}"] = int((got == ref).sum())
        entry["of"] = got.numel()
        spacing = torch.maximum(got.abs(), emulated.abs()).bfloat16().float()
        spacing = (
            torch.nextafter(spacing.bfloat16(), torch.tensor(float("inf"), dtype=torch.bfloat16)).float()
            - spacing
        )
        entry["max_bf16_ulps_vs_mlaq"] = float(((got - emulated).abs() / spacing.clamp(min=1e-38)).max())
        entry["diff_norm_over_quantization_error_norm"] = float(
            (got.double() - emulated.double()).norm() / quant_err
        )
        res[label] = entry
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--dump", help="also save FP8 dot inputs and the GPU's outputs (safetensors) here")
    args = p.parse_args()
    if args.dump and torch.cuda.is_available() and triton is not None:
        dump(args.dump)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = header(triton=getattr(triton, "__version__", None))
    run_sections(
        report,
        [("cast", lambda: part_cast(device))]
        + [(f"dot {label}", lambda k=k, m=m: part_dot(device, k, m)) for label, (k, m) in SHAPES.items()]
        + [
            (f"{name} {label}", lambda name=name, k=k, m=m: part_bmm(device, name, k, m))
            for name in ("fp8_per_tensor", "fp8_per_block")
            for label, (k, m) in SHAPES.items()
        ],
    )
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
