"""mlaq's C kernel's absorbed BMMs (``csrc/mla_bmm.c``): the ``bf16`` scheme's bits (its torch emulation,
``Bf16Reference``, is the oracle), from every instruction set and thread count, and what it refuses."""

from __future__ import annotations

import platform

import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.model.kernels.mla_kernel import BMM_COLS, MlaKernel, load_kernel
from mlaq.model.layers.mla_core import AbsorbedWeights, Precision
from mlaq.model.layers.mla_flash import flash_output, flash_queries


@pytest.fixture(scope="module")
def kernel() -> MlaKernel:
    return load_kernel()


def weights(n: int, p: int, lora: int, v: int, seed: int = 0) -> AbsorbedWeights:
    g = torch.Generator().manual_seed(seed)
    scheme = get_scheme("bf16")
    w_uk = torch.randn(n, p, lora, generator=g) * 0.05
    w_uk[0, 3, :5] = torch.tensor([1e-30, -1e30, 3e-39, 0.0, -0.0])  # huge, tiny and subnormal terms
    w_uv = torch.randn(n, lora, v, generator=g) * 0.05
    return AbsorbedWeights(
        scheme.prepare(w_uk), scheme.prepare(w_uv), scheme, scheme, Precision.DECODE_ONLY, None
    )


def run_both(kernel: MlaKernel, b: int, t: int, n: int, p: int, r: int, lora: int, v: int, seed: int = 0):
    """(kernel, torch emulation) for BMM #1 with the fold and BMM #2: bf16 outputs."""
    w = weights(n, p, lora, v, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = (torch.randn(b, t, n, p + r, generator=g) * 3).bfloat16()
    o = torch.randn(b, 1, n * t, lora + r, generator=g).bfloat16()
    mine = (kernel.absorb(q, w.w_uk.weight), kernel.up(o, w.w_uv.weight, t))
    theirs = (flash_queries(q[..., :p], q[..., p:], w), flash_output(o, w, n, torch.bfloat16))
    return mine, theirs


@pytest.mark.parametrize(
    ("b", "t", "n", "p", "r", "lora", "v"),
    [
        (1, 1, 4, 128, 64, 512, 128),  # DeepSeek-V3's per-head geometry, batch 1
        (3, 2, 4, 128, 64, 512, 128),  # verification rows; 6 rows: a group of 4 and one of 2
        (5, 3, 2, 32, 16, 64, 64),  # groups crossing batch rows, 15 rows
        (2, 1, 16, 192, 64, 512, 256),  # GLM's widths, many heads
    ],
)
def test_the_bf16_schemes_bits(kernel, b, t, n, p, r, lora, v):
    (absorbed, up), (want_absorbed, want_up) = run_both(kernel, b, t, n, p, r, lora, v)
    assert absorbed.shape == want_absorbed.shape and up.shape == want_up.shape
    assert torch.equal(absorbed, want_absorbed)  # [ql | q_pe], heads folded as flash_queries folds
    assert torch.equal(up, want_up)


def test_same_bits_on_one_thread_and_two(kernel):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run_both(kernel, 3, 2, 4, 128, 64, 512, 128, seed=3)
        torch.set_num_threads(2)
        two, _ = run_both(kernel, 3, 2, 4, 128, 64, 512, 128, seed=3)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, c) for a, c in zip(one, two, strict=True))


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_the_same_bits_from_another_instruction_set(march):
    """Without AVX-512 the double vectors are the compiler's generic ones (and no fused multiply-add:
    the products are exact, so the same bits)."""
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 instruction sets")
    (absorbed, up), (want_absorbed, want_up) = run_both(load_kernel(march=march), 3, 2, 4, 128, 64, 512, 128)
    assert torch.equal(absorbed, want_absorbed) and torch.equal(up, want_up)


def test_what_it_does_not_take_is_refused_clearly(kernel):
    q = torch.zeros(1, 1, 4, 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=f"M a multiple of {BMM_COLS}"):
        kernel.absorb(q, torch.zeros(4, 128, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        kernel.absorb(q, torch.zeros(4, 128, 64))
    with pytest.raises(ValueError, match="contiguous"):
        kernel.absorb(q, torch.zeros(4, 64, 128, dtype=torch.bfloat16).transpose(1, 2))
    weight = torch.zeros(4, 128, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="W_UK"):
        kernel.absorb(q[:, :, :2], weight)  # 2 heads, a weight of 4
    with pytest.raises(ValueError, match="W_UV"):
        kernel.up(torch.zeros(1, 1, 4, 128, dtype=torch.bfloat16), weight, 2)  # 4 rows is not N*T = 8
