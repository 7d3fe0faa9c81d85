"""``precision: absorbed``: vLLM's prefill attention computed in absorbed form with the emulated BMMs.

vLLM 0.32's ``MLAAttention.forward_impl`` (vllm/model_executor/layers/attention/mla_attention.py) sends
the step's prefill tokens to ``self.impl.forward_mha(q, kv_c_normed, k_pe, kv_cache, attn_metadata,
k_scale, output=..., output_scale=...)``, which decompresses every key with kv_b_proj (K_nope, V) and runs
ordinary attention. Under ``precision: absorbed`` the plugin puts :func:`absorbed_prefill` in its place:
per prefill request, mlaq's own absorbed attention (``mla_core.absorbed_attention``: BMM #1 q_nope W_UK
with the scheme, scores over the latent keys [c_kv | k_pe], causal softmax, o_latent, BMM #2 with the
scheme) on the request's new tokens: the arithmetic decode runs, activation rounding included, in pure
torch on the activations' device.

A prefill with prior context (chunked prefill, prefix-cache hits) would attend over latent entries of
earlier steps as well; the plugin does not read vLLM's paged cache for them: it refuses such a
configuration at start-up (:func:`check_no_prior_context`: prefix caching, chunked prefill,
speculative decoding, whose draft verification is a multi-token step after the cache) and, should one
reach it anyway, the step (:func:`absorbed_prefill`). vLLM-CPU turns the first two off for MLA models
by itself.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import Tensor

from mlaq.model.layers.mla_core import AbsorbedWeights, Precision, absorbed_attention


def context_refusal(layer_name: str, why: str) -> str:
    return (
        f"mlaq plugin: {layer_name}: precision absorbed computes prefill over the request's new tokens only, "
        f"and {why}. Run vLLM with --no-enable-prefix-caching --no-enable-chunked-prefill and without "
        "--speculative-config, or use precision consistent"
    )


def check_no_prior_context(layer_name: str, vllm_config: Any) -> None:
    """Refuse, at start-up, the vLLM settings under which a prefill can start after cached tokens."""
    cache, scheduler = vllm_config.cache_config, vllm_config.scheduler_config
    on = [
        flag
        for flag, value in (
            ("prefix caching", getattr(cache, "enable_prefix_caching", False)),
            ("chunked prefill", getattr(scheduler, "enable_chunked_prefill", False)),
            # draft tokens are verified as a multi-token step after the cache, a prefill on backends
            # whose decode takes one query token (vLLM-CPU's MLA backend among them)
            ("speculative decoding", getattr(vllm_config, "speculative_config", None) is not None),
        )
        if value
    ]
    if on:
        why = f"vLLM runs with {' and '.join(on)} on, under which a prefill can start after cached tokens"
        raise RuntimeError(context_refusal(layer_name, why))


def request_bounds(prefill: Any) -> list[tuple[int, int]]:
    """Each prefill request's [start, end) among the step's prefill tokens (host-side metadata)."""
    if prefill.query_lens_cpu is not None:
        starts = [0, *itertools.accumulate(int(n) for n in prefill.query_lens_cpu.tolist())]
    else:
        starts = prefill.query_start_loc.tolist()  # (R + 1,) prefill-relative offsets
    return list(itertools.pairwise(starts))


def absorbed_prefill(
    layer: Any,
    q: Tensor,
    kv_c_normed: Tensor,
    k_pe: Tensor,
    kv_cache: Tensor,
    attn_metadata: Any,
    k_scale: Tensor,
    output: Tensor,
    output_scale: Tensor | None = None,
) -> None:
    """``impl.forward_mha``'s signature. q (T, N, P+R) with q_pe rotated, kv_c_normed (T, L), k_pe
    (T, 1, R) or (T, R) rotated, output (T, N*V) written in place; kv_cache, k_scale unused."""
    prefill = attn_metadata.prefill
    if prefill.chunked_context is not None:
        why = "this step's prefill has prior context (chunked prefill or a prefix-cache hit)"
        raise RuntimeError(context_refusal(layer.layer_name, why))
    if output_scale is not None:
        raise RuntimeError(
            f"mlaq plugin: {layer.layer_name}: precision absorbed writes bf16 attention outputs; vLLM asked "
            "for a fused quantized output (an attention-quant fusion pass): turn that fusion off"
        )
    w_uk, w_uv = layer.W_UK_T, layer.W_UV  # the plugin's EmulatedBmmWeight objects
    weights = AbsorbedWeights(w_uk.prepared, w_uv.prepared, w_uk.scheme, w_uv.scheme, Precision.ABSORBED)
    p = layer.qk_nope_head_dim
    t_all = q.shape[0]
    latent = torch.cat((kv_c_normed, k_pe.reshape(t_all, -1)), dim=-1)  # (T, L+R): the cache entries
    for a, b in request_bounds(prefill):
        t = b - a
        q_nope, q_pe = q[a:b].split([p, q.shape[-1] - p], dim=-1)  # (t, N, P), (t, N, R)
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()[None]  # (1, t, t) causal
        o = absorbed_attention(
            q_nope[None], q_pe[None], latent[None, a:b], mask, weights, layer.impl.scale
        )  # (1, t, N, V)
        output[a:b].copy_(o.reshape(t, -1))
