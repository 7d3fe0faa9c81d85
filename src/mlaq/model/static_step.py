"""A decode / verification / MTP step without data-dependent Python control flow, for ``torch.compile``.

The eager model reads per-row starts as Python ints, routes MoE tokens with ``.tolist()`` and keeps a
cache object; each of those breaks a dynamo graph or forces a recompile per step. Here a step is a
function of tensors only: the gathered past latents (B, S, L+R) per layer, the new tokens' positions
(B, T) and their RoPE cos / sin. Keys are the past with the new entries scattered in at their
positions (as ``GatheredCache.update``); the causal mask is always built (the eager path skips it when
every key is visible: same softmax). Routed experts run on weights stacked once per MoE layer, so
shapes never depend on the routing.

Numerics: the same operations as the eager model, but fused kernels may round differently (last
bits); the absorbed BMMs keep their scheme's exact arithmetic: a scheme that is a plain matmul of
exact products (fp32 / bf16 reference) is traced, any other runs eagerly (``torch.compiler.disable``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mlaq.bmm.base import BmmScheme
from mlaq.model.decoder import DecoderLayer
from mlaq.model.deepseek import DeepseekForCausalLM
from mlaq.model.linear import linear
from mlaq.model.mla_core import AbsorbedWeights, absorbed_attention
from mlaq.model.moe import MoE
from mlaq.model.mtp import MTPLayer, select_rows

# Schemes whose apply is one float64 bmm of exactly representable products plus exact casts: inductor
# calls the same aten bmm, so tracing them keeps every bit. Others quantize activations (divisions,
# rounding) that a fused kernel could rewrite; they stay eager.
TRACEABLE_SCHEMES = frozenset({"fp32", "bf16"})


class _EagerScheme:
    """A scheme whose ``apply`` runs outside the compiled graph (bit-identical to eager by construction)."""

    def __init__(self, scheme: BmmScheme) -> None:
        self.scheme = scheme
        self.name = scheme.name
        self.apply = torch.compiler.disable(scheme.apply)


class _Experts(torch.nn.Module):
    """Routed experts' weights stacked: gate / up (E, I, H), down (E, H, I). Buffers of a module, so
    torch.compile treats them as the model's weights (frozen constants, guarded by identity) rather
    than as graph inputs whose shape and strides are checked on every call."""

    def __init__(self, gate: Tensor, up: Tensor, down: Tensor) -> None:
        super().__init__()
        self.register_buffer("gate", gate)
        self.register_buffer("up", up)
        self.register_buffer("down", down)


class StaticStep:
    """Trace-friendly absorbed-path steps of ``model`` (main layers, and MTP layer 0)."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        for layer in model.model.layers:
            if layer.indexer_kind is not None:
                raise ValueError(
                    "compile=True supports models without a DSA indexer (DeepSeek-V2/V3, Kimi-K2, "
                    "GLM-4.7-Flash); run this model with compile=False"
                )
        self.model = model
        self.weights = [self._absorbed(layer) for layer in model.model.layers]
        self.experts = [self._stacked(layer) for layer in model.model.layers]

    @staticmethod
    def _absorbed(layer: DecoderLayer) -> AbsorbedWeights:
        w = layer.self_attn._checked_absorbed()

        def wrap(s: BmmScheme) -> BmmScheme:
            return s if s.name in TRACEABLE_SCHEMES else _EagerScheme(s)  # type: ignore[return-value]

        return dataclasses.replace(w, scheme_uk=wrap(w.scheme_uk), scheme_uv=wrap(w.scheme_uv))

    @staticmethod
    def _stacked(layer: DecoderLayer) -> _Experts | None:
        if not isinstance(layer.mlp, MoE):
            return None
        live = layer.mlp._live_stack()  # the loader's stacked storage: views of it, no second copy
        if live is not None:
            gate, up, down = live  # (E*I, H), (E*I, H), (E, H, I)
            e, _, inter = down.shape
            return _Experts(gate.view(e, inter, -1), up.view(e, inter, -1), down)
        experts = layer.mlp._expert_list
        return _Experts(
            torch.stack([e.gate_proj.weight for e in experts]),
            torch.stack([e.up_proj.weight for e in experts]),
            torch.stack([e.down_proj.weight for e in experts]),
        )

    def decode(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Tensor | Sequence[Tensor],
        cos: Tensor,
        sin: Tensor,
        logits_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Main layers: ids / positions (B, T), past[i] (B, S, L+R) with S = max start, cos / sin
        (B, T, R) -> (logits (B, T or 1, vocab) fp32, hidden (B, T, H), entries (layers, B, T, L+R))."""
        m = self.model
        x = m.model.embed_tokens(input_ids)  # (B, T, H)
        mask = _causal(positions, past[0].shape[1] + positions.shape[1])
        entries = []
        for i, layer in enumerate(m._main_layers):
            x, entry = self._layer(i, layer, x, positions, past[i], cos, sin, mask)
            entries.append(entry)
        hidden = m.model.norm(x)
        # entries stacked in the graph: the engine stores them with one write
        return m.lm_head(select_rows(hidden, logits_index)).float(), hidden, torch.stack(entries)

    def mtp(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past: Tensor,
        cos: Tensor,
        sin: Tensor,
        logits_index: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """MTP layer 0 (as ``MTPLayer.predict``) -> (logits, output hidden (B, T, H), entries)."""
        m = self.model
        i = m.config.num_hidden_layers
        layer = m.model.layers[i]
        assert isinstance(layer, MTPLayer)
        embed = layer.embed_tokens if layer.embed_tokens is not None else m.model.embed_tokens
        head = layer.shared_head.head if layer.shared_head.head is not None else m.lm_head
        e = layer.enorm(embed(input_ids))  # (B, T, H)
        h = layer.hnorm(hidden.to(e.dtype))  # (B, T, H)
        x = layer.eh_proj(torch.cat((e, h), dim=-1))  # (B, T, 2H) -> (B, T, H)
        mask = _causal(positions, past.shape[1] + positions.shape[1])
        y, entry = self._layer(i, layer, x, positions, past, cos, sin, mask)
        logits = head(layer.shared_head.norm(select_rows(y, logits_index))).float()
        return logits, y, entry

    def _layer(
        self,
        i: int,
        layer: DecoderLayer,
        x: Tensor,
        positions: Tensor,
        past: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
    ) -> tuple[Tensor, Tensor]:
        attn = layer.self_attn
        b, t, _ = x.shape
        proj = attn.project(layer.input_layernorm(x), positions, (cos, sin))
        latent = proj.latent  # (B, T, L+R)
        keys = torch.cat((past, torch.zeros_like(latent)), dim=1)  # (B, S+T, L+R)
        keys = keys.scatter(1, positions[:, :, None].expand(-1, -1, latent.shape[2]), latent)
        o = absorbed_attention(proj.q_nope, proj.q_pe, keys, mask, self.weights[i], attn.softmax_scale)
        x = x + attn.o_proj(o.reshape(b, t, -1))  # (B, T, N*V) -> (B, T, H)
        h = layer.post_attention_layernorm(x)
        stacked = self.experts[i]
        mlp = layer.mlp(h) if stacked is None else _moe(layer.mlp, stacked, h)
        return x + mlp, latent


def _causal(positions: Tensor, num_keys: int) -> Tensor:
    """(B, T, K) bool: a query at position p sees key j iff j <= p."""
    key_pos = torch.arange(num_keys, device=positions.device)
    return key_pos[None, None, :] <= positions[:, :, None]


def _moe(moe: MoE, w: _Experts, x: Tensor) -> Tensor:
    """``MoE.forward`` with shapes independent of the routing: each token's k experts are summed in
    ascending expert order (the eager order). Few tokens gather their experts' weights; many run
    every expert (zero weight where not chosen: adding 0 changes no sum)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # (T, H)
    weights, indices = moe.gate(flat)  # (T, k) each
    n_tok, k = indices.shape
    num_experts = w.gate.shape[0]
    if n_tok * k < num_experts:
        if k <= 2:  # a sum of two terms is the same in either order (IEEE addition commutes)
            idx, wk = indices, weights
        else:  # a sort is an extern call of ~15 us a layer: only when the order matters
            idx, order = indices.sort(dim=-1)  # (T, k) ascending experts
            wk = weights.gather(1, order)  # (T, k)
        xs = flat[:, None, :, None]  # (T, 1, H, 1)
        a = F.silu((w.gate[idx] @ xs).squeeze(-1)) * (w.up[idx] @ xs).squeeze(-1)  # (T, k, I)
        y = (w.down[idx] @ a[..., None]).squeeze(-1)  # (T, k, H)
        y = (y * wk[..., None]).to(flat.dtype)
        out = y[:, 0]
        for j in range(1, k):
            out = out + y[:, j]
    else:
        e, inter, hid = w.gate.shape
        g = linear(flat, w.gate.reshape(e * inter, hid)).view(n_tok, e, inter)  # (T, E, I)
        u = linear(flat, w.up.reshape(e * inter, hid)).view(n_tok, e, inter)
        a = (F.silu(g) * u).transpose(0, 1)  # (E, T, I)
        y = torch.bmm(a, w.down.transpose(1, 2))  # (E, T, H)
        dense = torch.zeros(n_tok, e, dtype=weights.dtype, device=x.device).scatter(1, indices, weights)
        out = (y * dense.t()[:, :, None]).to(flat.dtype).sum(0)  # (T, H)
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(flat)
    return out.view(shape)
