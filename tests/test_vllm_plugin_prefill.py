"""``precision: absorbed``: the plugin's prefill (in place of vLLM 0.32's ``impl.forward_mha``) is mlaq's
``--precision absorbed`` prefill bit for bit on vLLM's tensor layout (tokens of several requests
concatenated; q (T, N, P+R), kv_c_normed (T, L), k_pe (T, 1, R), output (T, N*V)); prior context and
fused quantized outputs are refused with one message; no op leaves the activations' device."""

from types import SimpleNamespace

import pytest
import torch

from mlaq.bmm import get_scheme
from mlaq.integrations.vllm.emulate import emulated
from mlaq.integrations.vllm.hooks import _apply_absorbed_prefill
from mlaq.integrations.vllm.prefill import absorbed_prefill, check_no_prior_context
from mlaq.model.layers.mla import AttnPath, MLAConfig, MLAttention, Precision
from mlaq.model.layers.mla_latent import QUERY_BLOCK
from test_vllm_plugin_emulate import _move, _OffDevice

# DeepSeek-V3's latent geometry (L + R = 576, as vLLM's CPU MLA backend requires), 4 heads
CFG = MLAConfig(
    hidden_size=64, num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
)
LENGTHS = (5, 2 * QUERY_BLOCK + 3, 1)  # a short prompt, one through the blocked path, a single token


def _mlaq_layer(scheme: str, precision: Precision) -> MLAttention:
    torch.manual_seed(0)
    attn = MLAttention(CFG, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if "layernorm" in name
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
    attn.prepare(scheme, precision)
    return attn


def _vllm_layer(attn: MLAttention, scheme: str) -> SimpleNamespace:
    """What the plugin sees of vLLM's MLAAttention after its weight processing: W_UK_T (N, P, L) and
    W_UV (N, L, V) split from kv_b_proj and replaced by the emulated weights."""
    kv_b = attn.kv_b_proj.weight.detach().view(4, 256, 512)  # (N, P+V, L)
    sch = get_scheme(scheme)
    return SimpleNamespace(
        layer_name="model.layers.0.self_attn.attn",
        qk_nope_head_dim=128,
        W_UK_T=emulated(sch, kv_b[:, :128], "W_UK_T"),
        W_UV=emulated(sch, kv_b[:, 128:].transpose(1, 2), "W_UV"),
        impl=SimpleNamespace(scale=attn.softmax_scale),
        kv_cache_dtype="auto",
    )


def _step(attn: MLAttention, hiddens: list[torch.Tensor]):
    """vLLM's forward_mha inputs for requests prefilled together: their tokens concatenated."""
    projs = [attn.project(h, torch.arange(h.shape[1])[None]) for h in hiddens]
    q = torch.cat([torch.cat((p.q_nope, p.q_pe), dim=-1)[0] for p in projs])  # (T, N, P+R)
    latent = torch.cat([p.latent[0] for p in projs])  # (T, L+R)
    kv_c, k_pe = latent.split([512, 64], dim=-1)
    lens = torch.tensor([h.shape[1] for h in hiddens])
    prefill = SimpleNamespace(
        chunked_context=None, query_lens_cpu=lens, query_start_loc=torch.cat((torch.zeros(1), lens.cumsum(0)))
    )
    return q, kv_c, k_pe[:, None, :], SimpleNamespace(prefill=prefill)


@pytest.mark.parametrize("scheme", ["mxfp4", "fp8_per_tensor"])
def test_plugin_prefill_is_mlaqs_absorbed_prefill_bit_for_bit(scheme):
    attn = _mlaq_layer(scheme, Precision.ABSORBED)
    hiddens = [torch.randn(1, t, 64).bfloat16() for t in LENGTHS]
    q, kv_c, k_pe, meta = _step(attn, hiddens)
    out = torch.full((q.shape[0], 4 * 128), float("nan"), dtype=torch.bfloat16)
    absorbed_prefill(_vllm_layer(attn, scheme), q, kv_c, k_pe, None, meta, None, output=out)
    a = 0
    for h in hiddens:
        t = h.shape[1]
        want = attn(h, torch.arange(t)[None], path=AttnPath.NAIVE)[0]  # mlaq's prefill, (1, t, H)
        assert torch.equal(attn.o_proj(out[a : a + t][None]), want), (scheme, t)
        a += t
    attn.prepare(scheme, Precision.CONSISTENT)  # the same weights, activations unrounded: not the same
    t = LENGTHS[0]
    consistent = attn(hiddens[0], torch.arange(t)[None], path=AttnPath.NAIVE)[0]
    assert not torch.equal(attn.o_proj(out[:t][None]), consistent)


def test_prior_context_and_fused_output_are_refused():
    attn = _mlaq_layer("mxfp4", Precision.ABSORBED)
    layer = _vllm_layer(attn, "mxfp4")
    q, kv_c, k_pe, meta = _step(attn, [torch.randn(1, 3, 64).bfloat16()])
    out = torch.empty(3, 512, dtype=torch.bfloat16)
    meta.prefill.chunked_context = object()
    with pytest.raises(RuntimeError, match=r"layers\.0.*prior context.*--no-enable-prefix-caching"):
        absorbed_prefill(layer, q, kv_c, k_pe, None, meta, None, output=out)
    meta.prefill.chunked_context = None
    with pytest.raises(RuntimeError, match="fused quantized output"):
        absorbed_prefill(layer, q, kv_c, k_pe, None, meta, None, output=out, output_scale=torch.ones(1))


@pytest.mark.parametrize(
    ("prefix", "chunked", "spec", "words"),
    [
        (True, False, None, "prefix caching on"),
        (False, True, None, "chunked prefill on"),
        (True, True, None, "prefix caching and chunked prefill on"),
        (False, False, object(), "speculative decoding on"),
    ],
)
def test_start_up_refuses_settings_with_prior_context(prefix, chunked, spec, words):
    config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=prefix),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked),
        speculative_config=spec,
    )
    with pytest.raises(RuntimeError, match=words) as e:
        check_no_prior_context("model.layers.3.self_attn.attn", config)
    assert "--no-enable-chunked-prefill" in str(e.value) and "\n" not in str(e.value)
    layer = _vllm_layer(_mlaq_layer("mxfp4", Precision.ABSORBED), "mxfp4")
    with pytest.raises(RuntimeError, match=words):
        _apply_absorbed_prefill(layer, config)


def test_hook_replaces_forward_mha_where_allowed():
    off = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
        speculative_config=None,
    )
    layer = _vllm_layer(_mlaq_layer("mxfp4", Precision.ABSORBED), "mxfp4")
    _apply_absorbed_prefill(layer, off)
    assert layer.impl.forward_mha.func is absorbed_prefill and layer.impl.forward_mha.args == (layer,)
    layer.kv_cache_dtype = "fp8"
    with pytest.raises(RuntimeError, match="--kv-cache-dtype auto"):
        _apply_absorbed_prefill(layer, off)


def test_prefill_stays_on_the_activations_device():
    attn = _mlaq_layer("mxfp4", Precision.ABSORBED)
    layer = _vllm_layer(attn, "mxfp4")
    q, kv_c, k_pe, meta = _step(attn, [torch.randn(1, t, 64).bfloat16() for t in (5, 3)])
    for name in ("W_UK_T", "W_UV"):
        w = getattr(layer, name)
        setattr(layer, name, type(w)(w.scheme, _move(w.prepared, "meta"), w.name))
    out = torch.empty(8, 512, dtype=torch.bfloat16, device="meta")
    q, kv_c, k_pe = (x.to("meta") for x in (q, kv_c, k_pe))
    with _OffDevice() as rec:
        absorbed_prefill(layer, q, kv_c, k_pe, None, meta, None, output=out)
    assert rec.off == []
