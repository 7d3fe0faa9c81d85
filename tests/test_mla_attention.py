"""MLAttention: absorbed == naive, cache continuation, masking, batching, precision modes."""

from __future__ import annotations

import pytest
import torch

from mlaq.bmm import get_scheme, split_kv_b_proj, split_kv_b_proj_fp8
from mlaq.formats import Fp8Dtype, quantize_fp8_per_block
from mlaq.model.layers.mla import AttnPath, MLAttention
from mlaq.model.layers.mla_config import MLAConfig
from mlaq.model.layers.mla_core import Precision
from mlaq.model.layers.mla_latent import masked_softmax
from mlaq.model.layers.rope import YarnScaling

NAIVE, ABSORBED = AttnPath.NAIVE, AttnPath.ABSORBED
YARN = YarnScaling(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK = MLAConfig(64, 4, 512, 128, 64, 128, q_lora_rank=32, rope_scaling=YARN)
GLM5 = MLAConfig(64, 4, 512, 192, 64, 256, q_lora_rank=48, rope_theta=1e6)
DEEPSEEK_NO_QLORA = MLAConfig(64, 4, 512, 128, 64, 128, q_lora_rank=None, rope_scaling=YARN)
GEOMETRIES = pytest.mark.parametrize(
    "cfg", [DEEPSEEK, GLM5, DEEPSEEK_NO_QLORA], ids=["deepseek", "glm5", "no_qlora"]
)


def make_layer(cfg: MLAConfig, seed: int = 0, scheme: str | None = "fp32") -> MLAttention:
    torch.manual_seed(seed)
    layer = MLAttention(cfg)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            # norms near 1; projections scaled so scores are O(1) and softmax is not saturated
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if "layernorm" in name
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
    if scheme is not None:
        layer.prepare(scheme)
    return layer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def arange_pos(b: int, t: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(t) + start).expand(b, t).contiguous()


@GEOMETRIES
def test_absorbed_equals_naive_fp32(cfg):
    layer = make_layer(cfg)
    hidden = torch.randn(2, 9, cfg.hidden_size)
    out_n, ent_n = layer(hidden, arange_pos(2, 9), path=NAIVE)
    out_a, ent_a = layer(hidden, arange_pos(2, 9), path=ABSORBED)
    assert torch.equal(ent_n, ent_a) and ent_n.shape == (2, 9, cfg.latent_dim)
    assert rel(out_a, out_n) <= 1e-5, rel(out_a, out_n)
    assert out_n.shape == (2, 9, cfg.hidden_size) and out_n.dtype == torch.float32


@GEOMETRIES
@pytest.mark.parametrize("step", [1, 3], ids=["decode", "mtp_k2"])
def test_prefill_then_decode_equals_one_naive_pass(cfg, step):
    layer = make_layer(cfg, seed=1)
    total, prefill = 13, 4
    hidden = torch.randn(2, total, cfg.hidden_size)
    ref, ref_entries = layer(hidden, arange_pos(2, total), path=NAIVE)
    outs, cache = [], None
    out, cache = layer(hidden[:, :prefill], arange_pos(2, prefill), path=NAIVE)
    outs.append(out)
    for start in range(prefill, total, step):
        end = min(start + step, total)
        out, entries = layer(hidden[:, start:end], arange_pos(2, end - start, start), cache, path=ABSORBED)
        outs.append(out)
        cache = torch.cat((cache, entries), dim=1)  # (B, S, L+R) grows by the new entries
    assert rel(torch.cat(outs, dim=1), ref) <= 1e-5
    torch.testing.assert_close(cache, ref_entries, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", [NAIVE, ABSORBED])
def test_causal_future_tokens_do_not_change_earlier_outputs(path):
    layer = make_layer(DEEPSEEK, seed=2)
    hidden = torch.randn(1, 10, 64)
    changed = hidden.clone()
    changed[:, 6:] = torch.randn(1, 4, 64)
    out, _ = layer(hidden, arange_pos(1, 10), path=path)
    out2, _ = layer(changed, arange_pos(1, 10), path=path)
    assert torch.equal(out[:, :6], out2[:, :6])
    assert not torch.allclose(out[:, 6:], out2[:, 6:])


@pytest.mark.parametrize("path", [NAIVE, ABSORBED])
def test_batch_of_different_lengths_equals_each_row_alone(path):
    layer = make_layer(GLM5, seed=3)
    lens = [9, 5, 1]
    hidden = torch.randn(3, 9, 64)
    # prefill: right-padded rows, pad tokens continue the positions (so causality hides them)
    out, entries = layer(hidden, arange_pos(3, 9), path=path)
    nxt = torch.randn(3, 2, 64)  # then two MTP-style queries per row at each row's own positions
    positions = torch.tensor(lens)[:, None] + torch.arange(2)
    out2, _ = layer(nxt, positions, entries, torch.tensor(lens), path=path)
    for b, n in enumerate(lens):
        alone, alone_entries = layer(hidden[b : b + 1, :n], arange_pos(1, n), path=path)
        assert rel(out[b : b + 1, :n], alone) <= 1e-5
        alone2, _ = layer(nxt[b : b + 1], positions[b : b + 1], alone_entries, path=path)
        assert rel(out2[b : b + 1], alone2) <= 1e-5


@pytest.mark.parametrize("path", [NAIVE, ABSORBED])
def test_key_mask_selects_keys(path):
    """DSA-style key_mask: masked cache entries have no influence; the result equals the same attention
    computed over only the kept keys (a second formulation: gather them into a shorter cache)."""
    layer = make_layer(DEEPSEEK, seed=4)
    _, cache = layer(torch.randn(1, 8, 64), arange_pos(1, 8))
    keep = torch.tensor([0, 2, 3, 6])  # cached positions kept, plus the query itself (position 8)
    key_mask = torch.zeros(1, 1, 9, dtype=torch.bool)
    key_mask[0, 0, keep] = True
    key_mask[0, 0, 8] = True
    h = torch.randn(1, 1, 64)
    out, _ = layer(h, torch.tensor([[8]]), cache, path=path, key_mask=key_mask)
    poisoned = cache.clone()
    poisoned[:, [1, 4, 5, 7]] = 1e3 * torch.randn(1, 4, cache.shape[-1])
    out_p, _ = layer(h, torch.tensor([[8]]), poisoned, path=path, key_mask=key_mask)
    assert torch.equal(out, out_p)
    # gather the kept keys into a shorter cache: same softmax, so same output (positions only matter
    # for RoPE, which is already inside the cached k_pe and the query)
    proj = layer.project(h, torch.tensor([[8]]))
    keys = torch.cat((cache[:, keep], proj.latent), dim=1)  # (1, 5, L+R)
    mask = torch.ones(1, 1, 5, dtype=torch.bool)
    ref = layer.attend(proj.q_nope, proj.q_pe, keys, mask, path)
    assert rel(out, ref) <= 1e-6
    full, _ = layer(h, torch.tensor([[8]]), cache, path=path)
    assert rel(out, full) > 1e-3  # the mask did something


def test_cache_lens_hide_entries_past_each_rows_length():
    """Entries at positions >= cache_lens[b] are ignored even where causality alone would show them."""
    layer = make_layer(DEEPSEEK, seed=7)
    _, cache = layer(torch.randn(2, 6, 64), arange_pos(2, 6))
    lens = torch.tensor([6, 3])
    h = torch.randn(2, 1, 64)
    pos = torch.tensor([[6], [6]])  # row 1 has a gap: positions 3..5 are garbage, not history
    outs = []
    for fill in (0.0, 1e3):
        garbage = cache.clone()
        garbage[1, 3:] = fill
        outs.append(layer(h, pos, garbage, lens, path=ABSORBED)[0])
    assert torch.equal(outs[0], outs[1])
    unmasked = layer(h, pos, cache, path=ABSORBED)[0]
    assert torch.equal(unmasked[0], outs[0][0]) and not torch.allclose(unmasked[1], outs[0][1])


def test_softmax_probabilities_round_to_the_compute_dtype():
    scores = torch.randn(1, 2, 3, 5)
    mask = torch.ones(1, 3, 5, dtype=torch.bool)
    p32 = masked_softmax(scores, mask, torch.float32)
    p16 = masked_softmax(scores, mask, torch.bfloat16)
    assert p16.dtype == torch.float32 and torch.equal(p16, p32.bfloat16().float())
    assert not torch.equal(p16, p32)


def test_key_mask_too_short_and_wrong_dtype():
    layer = make_layer(DEEPSEEK)
    h = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="must cover positions"):
        layer(h, arange_pos(1, 2), key_mask=torch.ones(1, 2, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool tensor"):
        layer(h, arange_pos(1, 2), key_mask=torch.ones(1, 2, 2))
    out, _ = layer(h, arange_pos(1, 2), key_mask=torch.ones(1, 2, 40, dtype=torch.bool))  # wider: fine
    torch.testing.assert_close(out, layer(h, arange_pos(1, 2))[0])


def test_fully_masked_query_gives_zeros_not_nan():
    layer = make_layer(DEEPSEEK)
    out, _ = layer(torch.randn(1, 2, 64), arange_pos(1, 2), key_mask=torch.zeros(1, 2, 2, dtype=torch.bool))
    torch.testing.assert_close(
        out, layer.o_proj.bias if layer.o_proj.bias is not None else torch.zeros_like(out)
    )


def test_precision_modes_with_bf16_scheme():
    layer = make_layer(DEEPSEEK, seed=5, scheme=None)
    hidden, pos = torch.randn(2, 6, 64), arange_pos(2, 6)
    exact, _ = layer(hidden, pos, path=NAIVE)  # kv_b_proj at checkpoint precision (fp32 here)

    layer.prepare("bf16", Precision.DECODE_ONLY)
    naive_d, _ = layer(hidden, pos, path=NAIVE)
    absorbed_d, _ = layer(hidden, pos, path=ABSORBED)
    assert torch.equal(naive_d, exact)  # prefill untouched by the decode scheme
    assert 1e-4 < rel(absorbed_d, exact) < 2e-2  # decode sees bf16 rounding

    layer.prepare("bf16", Precision.CONSISTENT)
    naive_c, _ = layer(hidden, pos, path=NAIVE)
    absorbed_c, _ = layer(hidden, pos, path=ABSORBED)
    assert torch.equal(absorbed_c, absorbed_d)  # decode identical in both modes
    assert rel(naive_c, exact) > 1e-4  # prefill now uses the scheme's weights
    rounded = make_layer(DEEPSEEK, seed=5, scheme=None)
    with torch.no_grad():
        rounded.kv_b_proj.weight.copy_(rounded.kv_b_proj.weight.bfloat16().float())
    assert rel(naive_c, rounded(hidden, pos, path=NAIVE)[0]) <= 1e-6  # exactly: dequantized weights


@pytest.mark.parametrize("name", ["fp8_per_tensor", "fp8_per_tensor_fnuz", "mxfp4", "mxfp4_w4a16", "mxfp8"])
def test_quantized_schemes_decode_only_vs_consistent(name):
    """DECODE_ONLY: prefill stays exact, decode carries the scheme's error. CONSISTENT: prefill uses the
    scheme's dequantized weights, so for a weight-only scheme it lands next to decode (bf16 noise
    only), far closer than to the exact prefill."""
    layer = make_layer(GLM5, seed=8, scheme=None)  # P = 192: ragged K for 128-groups
    hidden, pos = torch.randn(2, 7, 64), arange_pos(2, 7)
    exact, _ = layer(hidden, pos, path=NAIVE)
    layer.prepare(name, Precision.DECODE_ONLY)
    assert torch.equal(layer(hidden, pos, path=NAIVE)[0], exact)
    absorbed = layer(hidden, pos, path=ABSORBED)[0]
    err = rel(absorbed, exact)
    assert 1e-3 < err < 0.3, err  # fp8 ~ 3e-2, mxfp4 ~ 1e-1 on random weights
    layer.prepare(name, Precision.CONSISTENT)
    naive_c = layer(hidden, pos, path=NAIVE)[0]
    assert torch.equal(layer(hidden, pos, path=ABSORBED)[0], absorbed)
    assert rel(naive_c, exact) > 1e-3
    if name == "mxfp4_w4a16":
        assert rel(absorbed, naive_c) < err / 5, (rel(absorbed, naive_c), err)


@pytest.mark.parametrize("name", ["fp8_per_tensor", "mxfp4"])
def test_absorbed_precision_prefills_through_the_schemes_bmms(name):
    """ABSORBED: prefill (path NAIVE) is the absorbed path bit for bit, activation rounding included, so
    it differs from CONSISTENT's prefill (same weights, unrounded activations) for a W8A8 / W4A4 scheme."""
    layer = make_layer(GLM5, seed=9, scheme=None).to(torch.bfloat16)
    hidden, pos = torch.randn(2, 7, 64).bfloat16(), arange_pos(2, 7)
    layer.prepare(name, Precision.CONSISTENT)
    consistent = layer(hidden, pos, path=NAIVE)[0]
    absorbed = layer(hidden, pos, path=ABSORBED)[0]
    layer.prepare(name, Precision.ABSORBED)
    prefill = layer(hidden, pos, path=NAIVE)[0]
    assert torch.equal(prefill, absorbed)
    assert torch.equal(layer(hidden, pos, path=ABSORBED)[0], absorbed)  # decode as in every mode
    assert rel(prefill.float(), consistent.float()) > 1e-3
    assert "absorbed" in repr(layer)


def test_checkpoint_fp8_block_weights_via_set_absorbed():
    """The models helper's path: a DeepSeek block-FP8 kv_b_proj (GLM-5 geometry: 128-row blocks straddle
    the P=192 / V=256 boundary) wrapped without re-quantization; naive at checkpoint precision."""
    layer = make_layer(GLM5, seed=10, scheme=None)
    c = GLM5
    ckpt = quantize_fp8_per_block(layer.kv_b_proj.weight.detach(), Fp8Dtype.E4M3FN)
    with torch.no_grad():
        layer.kv_b_proj.weight.copy_(ckpt.dequantize())  # what a loader does for the naive path
    (uk_codes, uk_scale), (uv_codes, uv_scale) = split_kv_b_proj_fp8(
        ckpt, c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    )
    scheme = get_scheme("fp8_per_block")
    w_uk, w_uv = scheme.prepare_quantized(uk_codes, uk_scale), scheme.prepare_quantized(uv_codes, uv_scale)
    hidden, pos = torch.randn(2, 5, 64), arange_pos(2, 5)
    layer.set_absorbed(w_uk, w_uv, scheme, precision=Precision.DECODE_ONLY)
    naive_d = layer(hidden, pos, path=NAIVE)[0]
    absorbed = layer(hidden, pos, path=ABSORBED)[0]
    layer.set_absorbed(w_uk, w_uv, scheme, precision=Precision.CONSISTENT)
    assert rel(layer(hidden, pos, path=NAIVE)[0], naive_d) <= 1e-6  # lossless: same weights both ways
    assert 1e-4 < rel(absorbed, naive_d) < 5e-2  # only activation fp8 + bf16 output rounding remain


def test_absorbed_requires_prepare_and_detects_stale_weights():
    layer = make_layer(DEEPSEEK, scheme=None)
    h = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="call prepare"):
        layer(h, arange_pos(1, 2), path=ABSORBED)
    layer.prepare("fp32")
    layer.load_state_dict(make_layer(DEEPSEEK, seed=9, scheme=None).state_dict())
    with pytest.raises(ValueError, match="changed after prepare"):
        layer(h, arange_pos(1, 2), path=ABSORBED)
    layer.prepare(get_scheme("fp32"))
    layer(h, arange_pos(1, 2), path=ABSORBED)
    assert "fp32/fp32" in repr(layer)


def test_set_absorbed_matches_prepare_and_validates():
    layer = make_layer(GLM5)
    h, pos = torch.randn(1, 3, 64), arange_pos(1, 3)
    ref, _ = layer(h, pos, path=ABSORBED)
    c = GLM5
    w_uk, w_uv_t = split_kv_b_proj(
        layer.kv_b_proj.weight.detach(), c.num_heads, c.qk_nope_head_dim, c.v_head_dim
    )
    assert w_uk.shape == (4, 192, 512) and w_uv_t.shape == (4, 512, 256)
    fp32, bf16 = get_scheme("fp32"), get_scheme("bf16")
    other = make_layer(GLM5, scheme=None)
    other.set_absorbed(fp32.prepare(w_uk.contiguous()), fp32.prepare(w_uv_t.contiguous()), fp32)
    assert torch.equal(other(h, pos, path=ABSORBED)[0], ref)
    with pytest.raises(ValueError, match="expected"):
        other.set_absorbed(fp32.prepare(w_uv_t.contiguous()), fp32.prepare(w_uk.contiguous()), fp32)
    with pytest.raises(ValueError, match="prepared by 'bf16'"):
        other.set_absorbed(fp32.prepare(w_uk.contiguous()), bf16.prepare(w_uv_t.contiguous()), fp32)
    other.set_absorbed(
        fp32.prepare(w_uk.contiguous()), bf16.prepare(w_uv_t.contiguous()), fp32, scheme_uv=bf16
    )
    assert 0 < rel(other(h, pos, path=ABSORBED)[0], ref) < 2e-2


def test_bf16_parameters():
    layer = make_layer(DEEPSEEK, seed=6, scheme=None).to(torch.bfloat16)
    layer.prepare("bf16")
    hidden = torch.randn(2, 5, 64).bfloat16()
    out_n, ent = layer(hidden, arange_pos(2, 5), path=NAIVE)
    out_a, _ = layer(hidden, arange_pos(2, 5), path=ABSORBED)
    assert out_n.dtype == out_a.dtype == ent.dtype == torch.bfloat16
    ref = make_layer(DEEPSEEK, seed=6)(hidden.float(), arange_pos(2, 5))[0]
    assert rel(out_n.float(), ref) < 3e-2 and rel(out_a.float(), ref) < 3e-2
    with pytest.raises(ValueError, match="cast it first"):
        layer(hidden.float(), arange_pos(2, 5))


def test_state_dict_has_hf_names_only():
    names = set(make_layer(DEEPSEEK).state_dict())
    assert names == {
        "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight",
    }  # fmt: skip
    assert set(make_layer(DEEPSEEK_NO_QLORA).state_dict()) - names == {"q_proj.weight"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"positions": torch.zeros(1, 3, dtype=torch.long)}, "positions must be integer"),
        ({"positions": torch.full((1, 2), -1)}, ">= 0"),
        ({"cache": torch.zeros(1, 4, 100)}, "cache must be"),
        ({"cache": torch.zeros(1, 4, 576), "cache_lens": torch.tensor([5])}, "cache_lens must be"),
        ({"cache_lens": torch.tensor([1])}, "without a cache"),
        ({"cache": torch.zeros(1, 4, 576, dtype=torch.float64)}, "latent cache is torch.float64"),
    ],
)
def test_bad_inputs(kwargs, match):
    layer = make_layer(DEEPSEEK)
    args = {"positions": arange_pos(1, 2), **kwargs}
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(1, 2, 64), **args)


def _unfused(q_nope, q_pe, keys, mask, kv_b, scale):
    """naive_attention's arithmetic written out in float64: the reference for the fused kernel."""
    b, _, n, p = q_nope.shape
    lora = kv_b.shape[1]
    kv = (keys[..., :lora].double() @ kv_b.double().T).view(b, keys.shape[1], n, -1)
    scores = torch.einsum("btnp,bsnp->bnts", q_nope.double(), kv[..., :p])
    scores = scores + torch.einsum("btnr,bsr->bnts", q_pe.double(), keys[..., lora:].double())
    probs = torch.softmax((scores * scale).masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.einsum("bnts,bsnv->btnv", probs, kv[..., p:])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kind", ["causal", "prefix", "padded"])
def test_fused_naive_attention_padded_v_matches_float64(dtype, tol, kind):
    """V (128) is zero-padded to QK's 192 for torch's flash kernel and a plain causal mask goes as
    is_causal; the output must still be the unfused attention's, under every mask shape."""
    from mlaq.model.layers.mla_core import is_causal, naive_attention

    g = torch.Generator().manual_seed(0)
    b, t, n, p, r, lora, v = 2, 40, 4, 128, 64, 512, 128
    k = t + (8 if kind == "prefix" else 0)
    q_nope = torch.randn(b, t, n, p, generator=g).to(dtype)
    q_pe = torch.randn(b, t, n, r, generator=g).to(dtype)
    keys = torch.randn(b, k, lora + r, generator=g).to(dtype)
    kv_b = (torch.randn(n * (p + v), lora, generator=g) / lora**0.5).to(dtype)
    mask = torch.ones(k, k, dtype=torch.bool).tril()[k - t :].expand(b, t, k).clone()
    if kind == "padded":
        mask[1, :, 30:] = False  # row 1 is 30 tokens long, right-padded: its pad queries see its 30 keys
    assert is_causal(mask) == (kind == "causal")
    got = naive_attention(q_nope, q_pe, keys, mask, kv_b, 192**-0.5)
    want = _unfused(q_nope, q_pe, keys, mask, kv_b, 192**-0.5)
    assert got.shape == (b, t, n, v) and got.dtype == dtype
    assert rel(got.double(), want) <= tol, rel(got.double(), want)


@pytest.mark.parametrize("kind", ["causal", "prefix"])
def test_float32_flash_where_bf16_gemms_run_through_float32(monkeypatch, kind):
    """On CPUs without a fast bf16 GEMM the flash kernel runs on the bf16 values held in float32: the
    probabilities are not rounded to bf16, so the output is closer to the exact attention than the bf16
    kernel's; elsewhere the bf16 kernel runs. Either way the output is bf16."""
    from mlaq.model.layers import mla_core

    g = torch.Generator().manual_seed(1)
    b, t, n, p, r, lora, v = 1, 96, 4, 128, 64, 512, 128
    k = t + (32 if kind == "prefix" else 0)
    q_nope = torch.randn(b, t, n, p, generator=g).bfloat16()
    q_pe = torch.randn(b, t, n, r, generator=g).bfloat16()
    keys = torch.randn(b, k, lora + r, generator=g).bfloat16()
    kv_b = (torch.randn(n * (p + v), lora, generator=g) / lora**0.5).bfloat16()
    mask = torch.ones(k, k, dtype=torch.bool).tril()[k - t :].expand(b, t, k).clone()
    want = _unfused(q_nope, q_pe, keys, mask, kv_b, 192**-0.5)
    out = {}
    for native in (True, False):
        monkeypatch.setattr(mla_core, "native_low_precision_gemm", lambda native=native: native)
        assert mla_core.float32_flash(q_nope) is not native
        out[native] = mla_core.naive_attention(q_nope, q_pe, keys, mask, kv_b, 192**-0.5)
        assert out[native].dtype == torch.bfloat16
    assert not torch.equal(out[True], out[False])
    assert rel(out[False].double(), want) < rel(out[True].double(), want)
    assert not mla_core.float32_flash(q_nope.float())  # float32 compute: nothing to change


def test_is_causal_only_for_the_exact_square_lower_triangle():
    from mlaq.model.layers.mla_core import is_causal

    tri = torch.ones(5, 5, dtype=torch.bool).tril()[None]
    assert is_causal(tri) and not is_causal(None)
    assert not is_causal(torch.ones(5, 6, dtype=torch.bool).tril(1)[None, :, :])  # a cached prefix
    off = tri.clone()
    off[0, 4, 0] = False
    assert not is_causal(off)
