"""The GPU side of bench/fp8_hardware.py: Triton kernels (the cast, one dot, the schemes' BMM loop) and
``dump``, which saves FP8 dot products and whole fp8_per_block BMMs with the GPU's outputs for fitting and
for the tests (tests/fixtures/h200_fp8_dots.safetensors). Imported by bench/fp8_hardware.py only where
CUDA and Triton are.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from mlaq.bmm import get_scheme
from mlaq.bmm.fp8_quant import FP8_GROUP, aiter_token_group_quant, deepseek_token_group_quant
from mlaq.formats import Fp8Dtype, fp8_cast


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask).to(tl.float8e4nv), mask=mask)


@triton.jit
def _bmm_kernel(
    a_ptr,
    b_ptr,
    as_ptr,
    ws_ptr,
    o_ptr,
    B,
    K,
    M,
    G,
    WS_PER_BLOCK: tl.constexpr,
    IMPRECISE: tl.constexpr,
    BB: tl.constexpr,
    BM: tl.constexpr,
    GROUP: tl.constexpr,
):
    n, pb, pm = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rb = pb * BB + tl.arange(0, BB)
    rm = pm * BM + tl.arange(0, BM)
    rk = tl.arange(0, GROUP)
    acc = tl.zeros((BB, BM), dtype=tl.float32)
    for g in range(0, G):
        k = g * GROUP + rk
        a = tl.load(
            a_ptr + n * B * K + rb[:, None] * K + k[None, :],
            mask=(rb[:, None] < B) & (k[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + n * K * M + k[:, None] * M + rm[None, :],
            mask=(k[:, None] < K) & (rm[None, :] < M),
            other=0.0,
        )
        a_s = tl.load(as_ptr + n * B * G + rb * G + g, mask=rb < B, other=0.0)
        if IMPRECISE > 0:  # noqa: SIM108 (a constexpr branch in a Triton kernel)
            dot = tl.dot(a, b, max_num_imprecise_acc=IMPRECISE)
        else:
            dot = tl.dot(a, b)
        if WS_PER_BLOCK:  # fp8_per_block: DeepGEMM's acc += dot * (a_scale * b_scale)
            b_s = tl.load(ws_ptr + n * G * M + g * M + rm, mask=rm < M, other=0.0)
            acc += dot * (a_s[:, None] * b_s[None, :])
        else:  # AITER: acc += dot * a_scale
            acc += dot * a_s[:, None]
    if not WS_PER_BLOCK:
        acc = acc * tl.load(ws_ptr)
    tl.store(
        o_ptr + n * B * M + rb[:, None] * M + rm[None, :],
        acc.to(tl.bfloat16),
        mask=(rb[:, None] < B) & (rm[None, :] < M),
    )


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, o_ptr, K: tl.constexpr, IMPRECISE: tl.constexpr):
    r = tl.arange(0, 64)
    k = tl.arange(0, K)
    a = tl.load(a_ptr + r[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * 64 + r[None, :])
    c = tl.load(c_ptr + r[:, None] * 64 + r[None, :])
    if IMPRECISE > 0:  # noqa: SIM108 (a constexpr branch in a Triton kernel)
        d = tl.dot(a, b, c, max_num_imprecise_acc=IMPRECISE)
    else:
        d = tl.dot(a, b, c)
    tl.store(o_ptr + r[:, None] * 64 + r[None, :], d)


def _codes(kind: str, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """Random e4m3fn codes: 'normal' (a scaled Gaussian), 'wide' (exponents spread over the whole
    range, random signs), 'positive' (wide, all positive: carries)."""
    if kind == "normal":
        return fp8_cast(torch.randn(shape, generator=g) * 64, Fp8Dtype.E4M3FN).to(torch.float8_e4m3fn)
    raw = torch.randint(0, 0x7F, shape, generator=g, dtype=torch.int32).to(torch.uint8)  # no NaN (0x7F)
    if kind == "wide":
        raw = raw | (torch.randint(0, 2, shape, generator=g, dtype=torch.int32).to(torch.uint8) << 7)
    return raw.view(torch.float8_e4m3fn)


def dump(path: str) -> None:
    """Inputs and the GPU's fp32 outputs of FP8 dot products, for fitting a model of the tensor cores
    offline: ``_scaled_mm`` (cuBLASLt, C = 0) and Triton's ``tl.dot`` with a random fp32 accumulator C."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    one = torch.tensor(1.0, device="cuda")
    out: dict[str, torch.Tensor] = {}
    for kind, k in itertools.product(("normal", "wide", "positive"), (16, 32, 64, 128)):
        a, b = _codes(kind, (64, k), g), _codes(kind, (k, 64), g)
        exact = a.float().double() @ b.float().double()
        c = (torch.randn(64, 64, generator=g).double() * exact.abs().mean().clamp(min=1e-30)).float()
        tag = f"{kind}_k{k}"
        out[f"{tag}_a"], out[f"{tag}_b"], out[f"{tag}_c"] = a.view(torch.uint8), b.view(torch.uint8), c
        bc = b.t().contiguous().cuda().t()
        out[f"{tag}_scaled_mm"] = torch._scaled_mm(a.cuda(), bc, one, one, out_dtype=torch.float32).cpu()
        for imprecise in (0, 32):
            for with_c in (False, True):
                o = torch.empty(64, 64, device="cuda")
                try:
                    _dot_kernel[(1,)](
                        a.cuda(),
                        b.contiguous().cuda(),
                        (c if with_c else torch.zeros_like(c)).cuda(),
                        o,
                        K=k,
                        IMPRECISE=imprecise,
                    )
                    out[f"{tag}_triton{'_imprecise32' if imprecise else ''}{'_c' if with_c else ''}"] = (
                        o.cpu()
                    )
                except Exception as exc:  # e.g. K below the instruction's
                    print(tag, imprecise, with_c, type(exc).__name__, str(exc)[:200])
    for k, m in ((192, 128), (512, 128)):  # whole fp8_per_block BMMs: GLM-5's ragged W_UK, W_UV
        x = torch.randn(4, 64, k, generator=g).bfloat16()
        w = (torch.randn(4, k, m, generator=g) * 0.05).bfloat16()
        prepared = get_scheme("fp8_per_block").prepare(w.float())
        tag = f"per_block_k{k}"
        out[f"{tag}_x"], out[f"{tag}_w"] = x, w
        for fusion in (True, False):
            out[f"{tag}_triton{'' if fusion else '_no_fusion'}"] = _triton_bmm(
                x, "fp8_per_block", prepared, fusion
            )
    save_file(out, path)
    print("dumped", len(out), "tensors to", path)


def _triton_bmm(x: torch.Tensor, name: str, prepared, fusion: bool, imprecise: int = 0) -> torch.Tensor:
    """The scheme's loop as a Triton kernel on the GPU's tensor cores, from mlaq's own codes and scales."""
    per_block = name.startswith("fp8_per_block")
    quant = deepseek_token_group_quant if per_block else aiter_token_group_quant
    xq, xs = quant(x, Fp8Dtype.E4M3FN)
    heads, tokens, k = x.shape
    m = prepared.shape[2]
    groups = -(-k // FP8_GROUP)
    ws = prepared.scale.contiguous() if per_block else prepared.scale.reshape(1).contiguous()
    if per_block:  # one scale per (head, 128-row block, column): these weights' blocks are the groups
        assert tuple(ws.shape) == (heads, groups, m), ws.shape
    out = torch.empty(heads, tokens, m, dtype=torch.bfloat16, device="cuda")
    grid = (heads, triton.cdiv(tokens, 64), triton.cdiv(m, 64))
    _bmm_kernel[grid](
        xq.to(torch.float8_e4m3fn).cuda(),
        prepared.codes.contiguous().cuda(),
        xs.contiguous().cuda(),
        ws.cuda(),
        out,
        tokens,
        k,
        m,
        groups,
        WS_PER_BLOCK=per_block,
        IMPRECISE=imprecise,
        BB=64,
        BM=64,
        GROUP=FP8_GROUP,
        enable_fp_fusion=fusion,
    )
    return out.float().cpu()
