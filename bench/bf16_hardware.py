"""mlaq's bf16 reference BMM against an NVIDIA GPU's bf16 tensor cores (what every engine runs by default).

    python bench/bf16_hardware.py --out bf16_hardware.json --dump bf16_dots.safetensors   # CUDA + Triton

1. Whole BMMs: ``get_scheme("bf16")`` (exact products summed once to fp32, then bf16) and ``bf16_sm90``
   (Hopper's tensor-core sums) against cuBLAS's bf16 ``torch.bmm`` (bf16 out), with torch's
   reduced-precision reduction allowed (its default) and not, on MLA's shapes (16 heads x 64 tokens;
   W_UK 128 -> 512, W_UV 512 -> 128); ``--dump`` saves smaller ones (4 heads) with cuBLAS's outputs.
2. ``--dump``: bf16 dot products (K = 16 .. 512; Gaussian, wide-exponent and all-positive values) with the
   tensor cores' fp32 results (Triton ``tl.dot`` from a zero and from a random fp32 accumulator), for
   fitting a model of the accumulation offline, as ``mlaq.bmm.tensor_core`` was fitted for FP8.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from gpu_report import finish, header, run_sections

from mlaq.bmm import get_scheme

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

SHAPES = {"W_UK": (128, 512), "W_UV": (512, 128)}

if triton is not None:

    @triton.jit
    def _dot_kernel(a_ptr, b_ptr, c_ptr, o_ptr, K: tl.constexpr):
        r = tl.arange(0, 64)
        k = tl.arange(0, K)
        a = tl.load(a_ptr + r[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * 64 + r[None, :])
        c = tl.load(c_ptr + r[:, None] * 64 + r[None, :])
        tl.store(o_ptr + r[:, None] * 64 + r[None, :], tl.dot(a, b, c))


def _values(kind: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    if kind == "normal":
        return torch.randn(shape, generator=g).bfloat16()
    mant = torch.randint(0, 128, shape, generator=g, dtype=torch.int32)
    exp = torch.randint(127 - 12, 127 + 12, shape, generator=g, dtype=torch.int32)  # 2^-12 .. 2^11
    sign = torch.randint(0, 2, shape, generator=g, dtype=torch.int32) if kind == "wide" else 0
    return ((sign << 15) | (exp << 7) | mant).to(torch.int16).view(torch.bfloat16)


def dump(path: str) -> None:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(11)
    out: dict[str, torch.Tensor] = {}
    for kind, k in itertools.product(("normal", "wide", "positive"), (16, 32, 64, 128, 512)):
        a, b = _values(kind, (64, k), g), _values(kind, (k, 64), g)
        exact = a.double() @ b.double()
        c = (torch.randn(64, 64, generator=g).double() * exact.abs().mean()).float()
        tag = f"{kind}_k{k}"
        out[f"{tag}_a"], out[f"{tag}_b"], out[f"{tag}_c"] = a, b, c
        for with_c in (False, True):
            o = torch.empty(64, 64, device="cuda")
            _dot_kernel[(1,)](
                a.cuda(), b.contiguous().cuda(), (c if with_c else torch.zeros_like(c)).cuda(), o, K=k
            )
            out[f"{tag}_triton{'_c' if with_c else ''}"] = o.cpu()
        try:  # cuBLAS with an fp32 result, where this torch has it
            out[f"{tag}_cublas_fp32"] = torch.mm(a.cuda(), b.cuda(), out_dtype=torch.float32).cpu()
        except (TypeError, RuntimeError) as exc:
            print(tag, "cuBLAS fp32-out:", type(exc).__name__, str(exc)[:120])
    for k, m in SHAPES.values():
        x = torch.randn(4, 64, k, generator=g).bfloat16()
        w = (torch.randn(4, k, m, generator=g) * 0.05).bfloat16()
        out[f"bmm_k{k}_x"], out[f"bmm_k{k}_w"] = x, w
        out[f"bmm_k{k}_cublas"] = torch.bmm(x.cuda(), w.cuda()).cpu()
    save_file(out, path)
    print("dumped", len(out), "tensors to", path, flush=True)


def part_bmm(k: int, m: int) -> dict:
    g = torch.Generator().manual_seed(k * 7 + m)
    x = torch.randn(16, 64, k, generator=g).bfloat16()
    w = torch.randn(16, k, m, generator=g) * 0.05
    scheme = get_scheme("bf16")
    prepared = scheme.prepare(w)
    ref = scheme.apply(x, prepared)
    sm90 = get_scheme("bf16_sm90")
    modelled = sm90.apply(x, sm90.prepare(w))
    exact = torch.bmm(x.double(), prepared.values)
    res: dict = {"bf16_rounding_rel_error": float((ref.double() - exact).norm() / exact.norm())}
    for reduced in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        got = torch.bmm(x.cuda(), prepared.weight.cuda()).float().cpu()
        diff = got != ref
        spacing = torch.maximum(got.abs(), ref.abs()).bfloat16()
        ulp = (torch.nextafter(spacing, torch.tensor(float("inf"), dtype=torch.bfloat16)) - spacing).float()
        res[f"cublas_reduced_precision_{reduced}"] = {
            "equal": int((~diff).sum()),
            "equal_to_bf16_sm90": int((got == modelled).sum()),
            "of": got.numel(),
            "max_bf16_ulps": float(((got - ref).abs() / ulp).max()),
            "diff_norm_over_bf16_rounding_norm": float(
                (got.double() - ref.double()).norm() / (ref.double() - exact).norm()
            ),
        }
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--dump", help="also save bf16 dot inputs and the GPU's fp32 outputs (safetensors) here")
    args = p.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("needs CUDA and Triton: nothing to measure here")
        return 0
    if args.dump:
        dump(args.dump)
    report = header()
    run_sections(report, [(label, lambda k=k, m=m: part_bmm(k, m)) for label, (k, m) in SHAPES.items()])
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
