"""``mlaq.bmm.check_kernel`` with real GPU kernels: the conformance grid run the way a kernel author would.

    python bench/check_gpu_kernels.py --out check_gpu_kernels.json     # on a CUDA machine with Triton

Kernels, each handed bf16 activations and the scheme's prepared weight, returning its output:
- cuBLAS's bf16 ``torch.bmm`` (what every engine runs by default), against ``bf16_sm90`` (Hopper's sums,
  modelled) and ``bf16`` (exact sums);
- a Triton kernel with DeepGEMM's loop on mlaq's FP8 codes and scales (bench/fp8_hardware_gpu.py), against
  ``fp8_per_block_sm90`` and ``fp8_per_block``.
Over ``check_kernel``'s default grid: ragged K (192, 80, 200, 16), batch 1..257, 1..128 heads.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from gpu_report import finish, header

from mlaq.bmm import check_kernel


def cublas_bf16(x: torch.Tensor, prepared) -> torch.Tensor:
    return torch.bmm(x.cuda(), prepared.weight.to(torch.bfloat16).cuda()).float().cpu()


def triton_fp8_per_block(x: torch.Tensor, prepared) -> torch.Tensor:
    from fp8_hardware_gpu import _triton_bmm

    return _triton_bmm(x, "fp8_per_block", prepared, fusion=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write a summary as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA (and Triton for the FP8 kernel): nothing to check here")
        return 0
    summary = header()
    for fn, schemes in (
        (cublas_bf16, ("bf16_sm90", "bf16")),
        (triton_fp8_per_block, ("fp8_per_block_sm90", "fp8_per_block")),
    ):
        for scheme in schemes:
            report = check_kernel(fn, scheme)
            print(report.format(), flush=True)
            summary[f"{fn.__name__} vs {scheme}"] = {
                "passed": report.passed,
                "shapes_flagged": sum(not c.passed for c in report.checks),
                "shapes": len(report.checks),
                "max_ulps": max(c.max_ulps for c in report.checks),
                "outputs_flagged": sum(c.flagged for c in report.checks),
                "outputs": sum(c.total for c in report.checks),
            }
    print(json.dumps(summary, indent=1))
    return finish(summary, args.out)


if __name__ == "__main__":
    sys.exit(main())
