"""mlaq.model.kernels.mla_kernel: mlaq's C kernel for the absorbed decode attention, against a float64 oracle
(the exact softmax attention), torch's fused kernel, and itself (threads, dtypes, masks, shapes)."""

from __future__ import annotations

import logging

import pytest
import torch

from mlaq.engine.compiled import _attention_kernel
from mlaq.model.kernels.mla_kernel import KernelUnavailable, MlaKernel, load_kernel
from mlaq.model.layers.mla_flash import flash_attend

D, DV = 96, 64  # key width L+R and value width L (multiples of the kernel's 16 lanes)


@pytest.fixture(scope="module")
def kernel() -> MlaKernel:
    return load_kernel()


def operands(b: int, n: int, t: int, k: int, dtype: torch.dtype, seed: int = 0, d: int = D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 1, n * t, d, generator=g).to(dtype)
    keys = torch.randn(b, k, d, generator=g).to(dtype)
    return q, keys


def oracle(q, keys, mask, n, scale, dv):
    """Softmax attention in float64: (B, 1, N*T, dv). Query row h*T + i uses mask[:, i]."""
    scores = (q.double()[:, 0] @ keys.double().transpose(1, 2)) * scale  # (B, N*T, K)
    if mask is not None:
        b, t, k = mask.shape
        rows = mask[:, None].expand(b, n, t, k).reshape(b, n * t, k)
        scores = scores.masked_fill(~rows, float("-inf"))
    return (scores.softmax(-1) @ keys.double()[..., :dv])[:, None]


def ragged_mask(starts: list[int], t: int, k: int) -> torch.Tensor:
    """(B, T, K): row b's token i at position starts[b] + i sees keys 0..starts[b] + i."""
    pos = torch.tensor(starts)[:, None] + torch.arange(t)
    return torch.arange(k)[None, None, :] <= pos[:, :, None]


@pytest.mark.parametrize(
    ("b", "n", "t", "k", "masked"),
    [
        (3, 4, 1, 200, False),  # three blocks of 64 keys and a partial one
        (2, 3, 1, 65, False),  # 3 query rows padded to 4; one key past a block, odd
        (1, 2, 4, 1, False),  # a single key
        (3, 2, 3, 150, True),  # verification (T = 3): causal within the new tokens, ragged rows
        (2, 16, 1, 64, True),  # many heads: four groups of query rows
        (2, 4, 2, 700, True),  # three segments of keys merged; row 1 sees none of the last two (below)
        (1, 4, 1, 600, False),  # batch 1: its segments are what runs in parallel
    ],
)
def test_float32_matches_the_exact_attention(kernel, b, n, t, k, masked):
    q, keys = operands(b, n, t, k, torch.float32)
    starts = [k - t - 3 * i for i in range(b)] if k < 700 else [697, 100]
    mask = ragged_mask(starts, t, k) if masked else None
    got = kernel.attend(q, keys, mask, n, 0.2, DV)
    want = oracle(q, keys, mask, n, 0.2, DV)
    assert got.shape == (b, 1, n * t, DV) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6)


def test_bf16_is_the_exact_attention_rounded_once(kernel):
    """Probabilities in float32 and one rounding at the end: nearly every output is the exact result
    rounded to bf16, the rest one bf16 step from it (torch's kernel rounds the probabilities to bf16
    before the value sum: a third of its outputs are off)."""
    q, keys = operands(8, 4, 1, 300, torch.bfloat16, seed=1, d=576)
    want = oracle(q, keys, None, 4, 0.05, 512)
    got = kernel.attend(q, keys, None, 4, 0.05, 512)
    assert got.dtype == torch.bfloat16
    rounded = want.to(torch.bfloat16)
    assert (got != rounded).float().mean() < 0.005
    step = (rounded.double().abs() * 2**-7).clamp_min(2**-133)  # one bf16 ulp (at most)
    assert ((got.double() - want).abs() <= step).all()
    theirs = flash_attend(q, keys, None, 4, 0.05)[..., :512]
    assert (theirs != rounded).float().mean() > 0.1  # the comparison above can tell the two apart


@pytest.mark.parametrize("batch", [6, 1])  # 1: its keys split into pieces that run in parallel, merged
def test_same_bits_on_one_thread_and_two(kernel, batch):
    q, keys = operands(batch, 4, 1, 333, torch.bfloat16, seed=2, d=576)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.attend(q, keys, None, 4, 0.07, 512)
        torch.set_num_threads(2)
        two = kernel.attend(q, keys, None, 4, 0.07, 512)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_keys_read_in_place_from_a_larger_buffer(kernel):
    """The engine's resident buffer: each row's keys are the first K positions of a longer row."""
    q, _ = operands(3, 4, 1, 1, torch.bfloat16)
    buffer = torch.randn(3, 90, D).to(torch.bfloat16)
    got = kernel.attend(q, buffer[:, :70], None, 4, 0.1, DV)
    assert torch.equal(got, kernel.attend(q, buffer[:, :70].contiguous(), None, 4, 0.1, DV))


def test_a_masked_key_has_no_weight(kernel):
    q, keys = operands(2, 4, 1, 130, torch.float32)
    mask = ragged_mask([9, 129], 1, 130)
    other = keys.clone()
    other[0, 10:] = 1e4  # row 0 sees keys 0..9 only
    assert torch.equal(kernel.attend(q, keys, mask, 4, 0.2, DV), kernel.attend(q, other, mask, 4, 0.2, DV))


def test_a_row_that_sees_no_key_is_nan_as_in_torch(kernel):
    q, keys = operands(1, 2, 1, 10, torch.float32)
    mask = torch.zeros(1, 1, 10, dtype=torch.bool)
    assert kernel.attend(q, keys, mask, 2, 0.2, DV).isnan().all()


def test_large_scores_neither_overflow_nor_underflow(kernel):
    """Online softmax: scores of +-1e4 (exp would overflow float32 without the running maximum)."""
    q, keys = operands(2, 4, 1, 150, torch.float32)
    got = kernel.attend(q * 100, keys, None, 4, 1.0, DV)
    torch.testing.assert_close(got.double(), oracle(q * 100, keys, None, 4, 1.0, DV), rtol=1e-5, atol=1e-5)


def test_operands_it_does_not_take_are_refused_clearly(kernel):
    q, keys = operands(1, 4, 1, 20, torch.bfloat16)
    assert not kernel.supports(q, keys.float(), DV)  # mixed dtypes
    assert not kernel.supports(q[..., :90], keys[..., :90], DV)  # width not a multiple of 16
    assert not kernel.supports(q, keys.transpose(1, 2).contiguous().transpose(1, 2), DV)  # columns strided
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.attend(q.half(), keys.half(), None, 4, 0.1, DV)


def test_built_once_per_source_and_compiler(kernel):
    again = load_kernel()
    assert again.path == kernel.path and kernel.path.exists()
    assert not list(kernel.path.parent.glob(f".{kernel.path.name}.*"))  # no partial build left behind


def test_without_a_compiler_auto_falls_back_to_torch_and_says_why(monkeypatch, caplog):
    def missing(compiler=None):
        raise KernelUnavailable("no C compiler 'cc' on PATH")

    monkeypatch.setattr("mlaq.engine.compiled.load_kernel", missing)
    with caplog.at_level(logging.WARNING, logger="mlaq.engine"):
        assert _attention_kernel("auto") is None
    assert "no C compiler" in caplog.text
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        _attention_kernel("mlaq")
    assert _attention_kernel("torch") is None
    with pytest.raises(ValueError, match="auto, mlaq, torch"):
        _attention_kernel("flash")


def test_a_missing_compiler_is_named():
    with pytest.raises(KernelUnavailable, match="no-such-cc"):
        load_kernel("no-such-cc")


def prefill_oracle(q, keys, values, scale):
    """Causal attention in float64, token i of T seeing keys 0 .. K - T + i: (B, N, T, V)."""
    t, k = q.shape[2], keys.shape[2]
    scores = (q.double() @ keys.double().transpose(-1, -2)) * scale
    hidden = torch.arange(k)[None, :] > (k - t + torch.arange(t))[:, None]
    return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ values.double()


@pytest.mark.parametrize(("t", "k"), [(130, 130), (37, 100), (1, 64)])
def test_prefill_matches_the_exact_causal_attention(kernel, t, k):
    """Square (a prompt) and T < K (new tokens after cached ones: bottom-right causal)."""
    g = torch.Generator().manual_seed(3)
    q, keys = torch.randn(2, 3, t, 48, generator=g), torch.randn(2, 3, k, 48, generator=g)
    values = torch.randn(2, 3, k, 32, generator=g)
    got = kernel.prefill(q, keys, values, 0.15)
    assert got.shape == (2, 3, t, 32)
    torch.testing.assert_close(got.double(), prefill_oracle(q, keys, values, 0.15), rtol=2e-6, atol=2e-6)


def test_prefill_takes_strided_operands_and_bf16(kernel):
    """The naive path hands it transposed views (B, N, T, D) of (B, T, N, D) tensors."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 70, 4, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    keys = torch.randn(2, 70, 4, 64, generator=g).to(torch.bfloat16).transpose(1, 2)
    values = torch.randn(2, 70, 4, 32, generator=g).to(torch.bfloat16).transpose(1, 2)
    got = kernel.prefill(q, keys, values, 0.125)
    want = prefill_oracle(q, keys, values, 0.125)
    assert got.dtype == torch.bfloat16
    assert (got != want.to(torch.bfloat16)).float().mean() < 0.01
    assert kernel.prefills(q, keys, values)
    long = torch.zeros(1, 1, 1025, 64, dtype=torch.bfloat16)
    assert not kernel.prefills(long, long, long[..., :32])  # past PREFILL_MAX_KEYS: torch's kernel


def test_the_naive_path_prefills_in_it_when_given(kernel):
    """``MLAttention.prefill_kernel``: a prompt's causal attention through mlaq's kernel agrees with
    torch's flash kernel to a bf16 rounding."""
    from mlaq.model.layers.mla_core import naive_attention

    g = torch.Generator().manual_seed(5)
    n, p, r, lora, v, t = 4, 32, 16, 64, 32, 40
    q_nope = torch.randn(1, t, n, p, generator=g).to(torch.bfloat16)
    q_pe = torch.randn(1, t, n, r, generator=g).to(torch.bfloat16)
    keys = torch.randn(1, t, lora + r, generator=g).to(torch.bfloat16)
    kv_b = (torch.randn(n * (p + v), lora, generator=g) / 8).to(torch.bfloat16)
    mine = naive_attention(q_nope, q_pe, keys, None, kv_b, 0.1, causal=True, kernel=kernel)
    theirs = naive_attention(q_nope, q_pe, keys, None, kv_b, 0.1, causal=True)
    assert mine.shape == theirs.shape == (1, t, n, v)
    assert not torch.equal(mine, theirs)  # it did run (the two round differently)
    torch.testing.assert_close(mine.float(), theirs.float(), rtol=2**-6, atol=2**-6)


def test_the_bits_are_pinned(kernel):
    """The arithmetic is fixed by the source (no reassociation, no contraction the source does not
    write): these operands give these bits on every CPU and thread count. A change of the kernel's
    arithmetic (or a compiler that reorders it) changes the digest."""
    import hashlib

    q, keys = operands(3, 4, 2, 150, torch.bfloat16, seed=7, d=576)
    mask = ragged_mask([147, 100, 60], 2, 150)
    decode = kernel.attend(q, keys, mask, 4, 0.0625, 512)
    g = torch.Generator().manual_seed(8)
    pq, pk, pv = (torch.randn(1, 2, 90, w, generator=g).to(torch.bfloat16) for w in (192, 192, 128))
    prefill = kernel.prefill(pq, pk, pv, 0.07)
    q1, keys1 = operands(1, 4, 1, 600, torch.bfloat16, seed=9, d=576)
    split = kernel.attend(q1, keys1, None, 4, 0.0625, 512)  # batch 1: pieces of the keys, merged
    digest = hashlib.sha256(
        split.view(torch.int16).numpy().tobytes()
        + decode.view(torch.int16).numpy().tobytes()
        + prefill.view(torch.int16).numpy().tobytes()
    )
    assert digest.hexdigest()[:16] == PINNED


PINNED = "a72953b82cb3f464"


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])
def test_the_same_bits_from_another_instruction_set(march):
    """AVX2 (two ymm per vector) and SSE4 without FMA hardware (fmaf in software): the pinned bits."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 instruction sets")
    test_the_bits_are_pinned(load_kernel(march=march))


def test_a_nan_in_the_cache_reaches_the_output(kernel):
    """Not hidden as a zero probability: the rows that see a NaN key are NaN, the others are not."""
    q, keys = operands(2, 4, 1, 100, torch.float32)
    keys[0, 37, 5] = float("nan")
    got = kernel.attend(q, keys, None, 4, 0.2, DV)
    assert got[0].isnan().all() and not got[1].isnan().any()


def test_operands_whose_shapes_disagree_are_refused_before_the_c_code_runs(kernel):
    q, keys = operands(2, 4, 1, 20, torch.float32)
    with pytest.raises(ValueError, match="keys \\(B, K, D\\)"):
        kernel.attend(q, keys[..., :80].contiguous(), None, 4, 0.1, DV)  # narrower keys than queries
    with pytest.raises(ValueError, match="keys \\(B, K, D\\)"):
        kernel.attend(q, keys[:1], None, 4, 0.1, DV)  # fewer batch rows of keys
    with pytest.raises(ValueError, match="mask"):
        kernel.attend(q, keys, torch.ones(2, 1, 19, dtype=torch.bool), 4, 0.1, DV)
    with pytest.raises(ValueError, match="bool"):  # read as bytes by the C code: 0 / 1 only
        kernel.attend(q, keys, torch.ones(2, 1, 20), 4, 0.1, DV)
    x = torch.zeros(1, 2, 8, 32)
    with pytest.raises(ValueError, match="K >= T"):
        kernel.prefill(x, x[:, :, :4], x[:, :, :4], 0.1)  # fewer keys than new tokens
