"""How much of an absorbed-MLA decode layer the two BMMs are on a real GPU, in bf16 and in FP8.

    python bench/bmm_gpu_speed.py --out bmm_gpu_speed.json      # on a CUDA machine (Hopper for FP8)

DeepSeek-V3 geometry, one layer, decode: N = 128 heads, P = V = 128, L = 512, R = 64; B requests each with
S cached tokens. Timed with ``triton.testing.do_bench`` (median, L2 flushed between runs), bf16:
- BMM #1 (q absorption) ``(N, B, P) x (N, P, L)`` and BMM #2 (V up-projection) ``(N, B, L) x (N, L, V)``,
  cuBLAS ``torch.bmm``;
- the same in FP8 through ``torch._scaled_grouped_mm`` (a CUTLASS grouped GEMM: e4m3 weights with one scale
  per head and output column, activations quantized per token: ``fp8_per_channel``'s weights with a
  coarser activation scale), plus the activation quantization as torch ops, timed apart;
- the attention over the latent cache it sits between: scores ``q_lat . [c_kv | k_pe]`` over S tokens,
  softmax, ``P . c_kv`` (cuBLAS bmm, bf16), the part that reads the whole cache.
Not mlaq's emulation: these are the GPU's own kernels, to size what re-quantizing the BMMs can save.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from gpu_report import finish, header

N, P, L, R, V = 128, 128, 512, 64, 128
BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 8192, 32768)


def _fp8_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K, M) bf16 -> e4m3fn codes, column-major per head as CUTLASS wants, and (N, M) fp32 scales."""
    scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 448.0  # (N, M)
    codes = (w.float() / scale[:, None, :]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes.transpose(1, 2).contiguous().transpose(1, 2), scale


def _quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, B, K) bf16 -> e4m3fn codes and (N, B) fp32 per-token scales (torch ops, several kernels)."""
    scale = x.float().abs().amax(dim=2).clamp(min=1e-12) / 448.0
    return (x.float() / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))  # ms, median


def measure(batch: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch)
    w_uk = (torch.randn(N, P, L, device="cuda", generator=g) * 0.05).bfloat16()
    w_uv = (torch.randn(N, L, V, device="cuda", generator=g) * 0.05).bfloat16()
    q_nope = torch.randn(N, batch, P, device="cuda", generator=g).bfloat16()
    o_lat = torch.randn(N, batch, L, device="cuda", generator=g).bfloat16()
    res: dict = {
        "bf16_bmm1_ms": _bench(lambda: torch.bmm(q_nope, w_uk)),
        "bf16_bmm2_ms": _bench(lambda: torch.bmm(o_lat, w_uv)),
    }
    try:
        uk8, uk_s = _fp8_weight(w_uk)
        uv8, uv_s = _fp8_weight(w_uv)
        rows = -(-batch // 16) * 16  # CUTLASS wants M a multiple of 16: fewer tokens are padded
        pad = (0, 0, 0, rows - batch)
        q_pad, o_pad = torch.nn.functional.pad(q_nope, pad), torch.nn.functional.pad(o_lat, pad)
        xq1, xs1 = _quant_act(q_pad)
        xq2, xs2 = _quant_act(o_pad)
        res["fp8_rows"] = rows

        def fp8(xq, xs, w8, ws):
            return torch._scaled_grouped_mm(xq, w8, xs, ws, out_dtype=torch.bfloat16)

        got = fp8(xq1, xs1, uk8, uk_s).float()[:, :batch]
        want = torch.bmm(q_nope.float(), w_uk.float())
        res["fp8_bmm1_rel_error"] = float((got - want).norm() / want.norm())
        res["fp8_bmm1_ms"] = _bench(lambda: fp8(xq1, xs1, uk8, uk_s))
        res["fp8_bmm2_ms"] = _bench(lambda: fp8(xq2, xs2, uv8, uv_s))
        res["fp8_act_quant_ms"] = _bench(lambda: (_quant_act(q_pad), _quant_act(o_pad)))
    except Exception as exc:  # an API this torch lacks: keep the bf16 figures
        res["fp8_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    for s in CONTEXTS:
        if batch * s * (L + R) * 2 > 24 * 2**30:
            continue  # more cache than this bench should allocate
        cache = torch.randn(batch, s, L + R, device="cuda", generator=g).bfloat16()
        q = torch.randn(batch, N, L + R, device="cuda", generator=g).bfloat16()

        def attend(q=q, cache=cache):
            p = torch.softmax(torch.bmm(q, cache.transpose(1, 2)).float() * (P + R) ** -0.5, dim=-1)
            return torch.bmm(p.bfloat16(), cache[:, :, :L])

        res[f"attention_ms_ctx{s}"] = _bench(attend)
        del cache
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: nothing to measure here")
        return 0
    report = header(shape=dict(N=N, P=P, L=L, R=R, V=V))
    for b in BATCHES:
        report[f"batch{b}"] = r = measure(b)
        print(f"batch {b}", json.dumps(r), flush=True)
        bmm = r["bf16_bmm1_ms"] + r["bf16_bmm2_ms"]
        for s, key in itertools.product(CONTEXTS, ["attention_ms_ctx"]):
            if f"{key}{s}" in r:
                share = bmm / (bmm + r[f"{key}{s}"])
                print(
                    f"  ctx {s}: bf16 BMMs {bmm * 1e3:.1f} us = {share:.1%} of BMMs + attention", flush=True
                )
    return finish(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
