"""Blocked latent attention (long masked query runs): the same weights and outputs as the whole-matrix
softmax, fewer multiply-adds."""

from __future__ import annotations

import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.model.layers import mla_core, mla_latent
from mlaq.model.layers.mla_core import AbsorbedWeights, Precision, absorbed_attention
from mlaq.model.layers.mla_latent import QUERY_BLOCK, latent_attention_blocked, masked_softmax

N, P, R, L, V = 4, 32, 16, 64, 32


def whole(q: torch.Tensor, kf: torch.Tensor, mask: torch.Tensor, scale: float, dtype: torch.dtype):
    """The unblocked reference: one (T, K) score matrix per head."""
    b, n, t, c = q.shape
    scores = torch.bmm(q.reshape(b, n * t, c), kf.transpose(1, 2)).view(b, n, t, -1) * scale
    probs = masked_softmax(scores, mask, dtype)  # (B, N, T, K)
    return torch.bmm(probs.view(b, n * t, -1), kf[:, :, :L]).view(b, n, t, L)


def operands(b: int, t: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, N, t, L + R, generator=g).to(dtype).float()
    kf = torch.randn(b, k, L + R, generator=g).to(dtype).float()
    return q, kf


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest value (fp32 reassociation: ~1e-7)."""
    return float((a - b).abs().max() / b.abs().max())


def assert_same_sums(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """``got`` (the blocked path) against the whole-matrix float32 ``want``: float32 to reassociation;
    bf16 equal to ``want`` rounded to bf16, or one bf16 step from it where the GEMM summed in another
    order (latent_values: a bf16 GEMM on CPUs that have one) and crossed a rounding boundary."""
    if dtype == torch.float32:
        assert close(got, want) <= 1e-6, close(got, want)
        return
    rounded = want.to(dtype).float()
    diff = (got - rounded).abs()
    # one bf16 step of the result, plus float32 reassociation where the sum cancels to near zero
    bound = rounded.abs() * 2**-7 + 1e-6 * want.abs().max()
    assert (diff <= bound).all(), float((diff / bound).max())
    assert (diff > 0).float().mean() <= 2e-3, float((diff > 0).float().mean())
    assert torch.equal(got, got.to(dtype).float())  # o_latent is rounded to the compute dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [2 * QUERY_BLOCK + 37, 1100])
def test_causal_blocks_equal_the_whole_matrix(t, dtype):
    q, kf = operands(1, t, t, dtype)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]  # (1, T, K)
    got = latent_attention_blocked(q, kf, mask, L, 0.05, dtype)
    want = whole(q, kf, mask, 0.05, dtype)
    assert got.shape == want.shape == (1, N, t, L)
    assert_same_sums(got, want, dtype)


def test_holes_empty_rows_and_batches():
    """A DSA-like mask: random holes, rows of a batch reaching different keys, rows seeing nothing."""
    b, t, k = 2, 700, 900
    q, kf = operands(b, t, k, torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(b, t, k, generator=g) < 0.3
    mask[0, :, 600:] = False  # row 0 never reaches the last keys
    mask[1, 5] = False  # a query that sees no key
    mask[0, QUERY_BLOCK : 2 * QUERY_BLOCK] = False  # a whole block sees no key
    got = latent_attention_blocked(q, kf, mask, L, 0.1, torch.bfloat16)
    want = whole(q, kf, mask, 0.1, torch.bfloat16)
    assert torch.isfinite(got).all()
    assert torch.equal(got[1, :, 5], torch.zeros(N, L))
    assert torch.equal(got[0, :, QUERY_BLOCK : 2 * QUERY_BLOCK], torch.zeros(N, QUERY_BLOCK, L))
    assert_same_sums(got, want, torch.bfloat16)


def test_keys_past_a_blocks_reach_are_not_read(monkeypatch):
    """Under a causal mask the first block multiplies against at most KEY_ALIGN keys, not all T."""
    t = 4 * QUERY_BLOCK
    q, kf = operands(1, t, t, torch.float32)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    widths = []
    real_bmm = torch.bmm

    def spy(a, b2):
        widths.append(b2.shape[-1] if b2.shape[-1] != L else b2.shape[-2])  # keys of each product
        return real_bmm(a, b2)

    monkeypatch.setattr(mla_latent.torch, "bmm", spy)
    latent_attention_blocked(q, kf, mask, L, 0.05, torch.float32)
    monkeypatch.undo()
    assert max(widths) == t and min(widths) == min(t, mla_latent.KEY_ALIGN), widths
    assert sum(widths) < 0.8 * 2 * (t // QUERY_BLOCK) * t  # fewer key columns than the whole matrix


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4", "fp8_per_tensor"])
def test_absorbed_attention_takes_the_blocked_path_for_long_runs(scheme):
    """absorbed_attention on a long causal window equals the whole-matrix computation of the same BMMs."""
    torch.manual_seed(3)
    t = 2 * QUERY_BLOCK + 5
    q_nope = torch.randn(1, t, N, P).bfloat16()
    q_pe = torch.randn(1, t, N, R).bfloat16()
    keys = torch.randn(1, t, L + R).bfloat16()
    w_uk, w_uv = torch.randn(N, P, L) / 8, torch.randn(N, L, V) / 8
    sch = get_scheme(scheme)
    w = AbsorbedWeights(sch.prepare(w_uk), sch.prepare(w_uv), sch, sch, Precision.DECODE_ONLY)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    got = absorbed_attention(q_nope, q_pe, keys, mask, w, 0.07)
    q = mla_core.absorbed_queries(q_nope, q_pe, w)
    o_latent = whole(q, keys.float(), mask, 0.07, torch.bfloat16).transpose(0, 1).bfloat16()
    want = sch.apply(o_latent.reshape(N, t, L), w.w_uv).view(N, 1, t, V).permute(1, 2, 0, 3).bfloat16()
    diff = (got.float() - want.float()).abs()
    # bf16 outputs: equal, or where fp32 reassociation crossed a rounding boundary, apart by at most one bf16
    # step of the output plus what one bf16 step (2^-7 relative) in every latent input can move it: near a
    # cancellation (|out| << sum |o| |w_uv|) the second term dominates, and the GEMM's summation order is the
    # CPU's (it differs between AVX-512 kernels)
    spread = (o_latent.float().abs().reshape(N, t, L) @ w_uv.abs()).view(N, 1, t, V).permute(1, 2, 0, 3)
    assert (diff <= (want.float().abs() + spread) * 2**-7).all()
    assert (diff > 0).float().mean() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("holes", ["causal", "holes_and_empty_rows", "none"])
def test_in_place_masked_softmax_equals_masked_softmax(dtype, holes):
    """masked_softmax_ (the absorbed path's, in place) gives masked_softmax's values bit for bit."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2, N, 50, 70, generator=g) * 4
    mask = (
        None if holes == "none" else torch.ones(50, 70, dtype=torch.bool).tril(20).expand(2, 50, 70).clone()
    )
    if holes == "holes_and_empty_rows":
        mask &= torch.rand(2, 50, 70, generator=g) < 0.5
        mask[1, 7] = False  # a row that sees no key: zeros
    want = mla_latent.masked_softmax(scores, mask, dtype)
    owned = scores.clone()
    got = mla_latent.masked_softmax_(owned, mask, dtype)
    assert got.data_ptr() == owned.data_ptr()  # in place
    assert torch.equal(got, want)
    assert not torch.isnan(got).any()
    if holes == "holes_and_empty_rows":
        assert torch.equal(got[1, :, 7], torch.zeros(N, 70))


def test_in_place_masked_softmax_under_autograd_is_out_of_place():
    scores = torch.randn(1, N, 5, 5, requires_grad=True)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    got = mla_latent.masked_softmax_(scores * 1.0, mask, torch.float32)
    got.sum().backward()  # differentiable
    assert torch.equal(got, mla_latent.masked_softmax(scores, mask, torch.float32))


@pytest.mark.parametrize("native", [True, False])
def test_value_matmul_rounds_the_exact_sum_once_to_bf16(monkeypatch, native):
    """latent_values: the bf16 GEMM (CPUs with one) and the float32 GEMM rounded to bf16 both give the
    exact sum rounded to bf16, up to one step where fp32 accumulation order crossed a boundary; in float32
    it is the plain float32 product."""
    monkeypatch.setattr(mla_latent, "native_low_precision_gemm", lambda: native)
    g = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(2, 300, 700, generator=g) * 3, -1).bfloat16().float()
    c_kv = torch.randn(2, 700, L, generator=g).bfloat16()
    got = mla_latent.latent_values(probs, c_kv, torch.bfloat16)
    exact = torch.bmm(probs.double(), c_kv.double())
    assert_same_sums(got, exact.float(), torch.bfloat16)
    plain = mla_latent.latent_values(probs, c_kv.float(), torch.float32)
    assert torch.equal(plain, torch.bmm(probs, c_kv.float()))


def test_keys_held_in_float32_take_the_float32_gemm(monkeypatch):
    """c_kv held in float32 (the engine's resident buffer): the float32 GEMM rounded to bf16, also where
    a native bf16 GEMM exists (no conversion pass), the same as a CPU without one computes."""
    g = torch.Generator().manual_seed(6)
    probs = torch.softmax(torch.randn(3, 4, 500, generator=g) * 3, -1).bfloat16().float()
    c_kv = torch.randn(3, 500, L, generator=g).bfloat16()
    monkeypatch.setattr(mla_latent, "native_low_precision_gemm", lambda: False)
    without = mla_latent.latent_values(probs, c_kv, torch.bfloat16)
    monkeypatch.setattr(mla_latent, "native_low_precision_gemm", lambda: True)
    held = mla_latent.latent_values(probs, c_kv.float(), torch.bfloat16)
    assert torch.equal(held, without)
    assert torch.equal(held, torch.bmm(probs, c_kv.float()).bfloat16().float())


def test_attend_takes_float32_held_keys_on_the_absorbed_path_only():
    from mlaq.model.layers.mla import AttnPath, MLAConfig, MLAttention

    cfg = MLAConfig(
        hidden_size=32, num_heads=N, q_lora_rank=None, kv_lora_rank=L, qk_nope_head_dim=P,
        qk_rope_head_dim=R, v_head_dim=V,
    )  # fmt: skip
    torch.manual_seed(0)
    attn = MLAttention(cfg, dtype=torch.bfloat16)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    attn.prepare("bf16")
    hidden = torch.randn(2, 1, 32).bfloat16()
    proj = attn.project(hidden, torch.tensor([[9], [9]]))
    keys = torch.randn(2, 10, L + R).bfloat16()
    as_bf16 = attn.attend(proj.q_nope, proj.q_pe, keys, None, AttnPath.ABSORBED)
    as_fp32 = attn.attend(proj.q_nope, proj.q_pe, keys.float(), None, AttnPath.ABSORBED)
    diff = (as_fp32.float() - as_bf16.float()).abs()
    assert (diff <= as_bf16.float().abs() * 2**-6 + 1e-3).all()  # the value GEMM's order at most
    with pytest.raises(ValueError, match=r"latent cache is torch\.float32"):
        attn.attend(proj.q_nope, proj.q_pe, keys.float(), None, AttnPath.NAIVE)
