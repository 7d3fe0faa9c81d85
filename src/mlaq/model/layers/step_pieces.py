"""A decode / verification / MTP step cut at each layer's attention over the cache, for ``torch.compile``.

What a step does per token (norms, the projections, RoPE, the absorbed BMMs, o_proj, the residuals,
the MLP or MoE, the final norm and lm_head) is hundreds of small tensor ops; inductor fuses them into
a few C++ kernels around the GEMMs. What a step does over the cache (writing the new latents, the
scores and the value matmul over every cached key) stays eager, between the pieces, as vLLM's
piecewise graphs leave attention to its own kernel: the cache grows every step and is the engine's
resident buffer, written in place. The BMM schemes are exact emulations that must keep their
arithmetic bit for bit: a layer's BMM #1 (end of a piece) and #2 (start of the next) run inside the
pieces where its scheme says inductor reproduces it exactly (``BmmScheme.compiles_exactly``), and
eagerly with the attention otherwise (:meth:`StepPieces.folds`).

The pieces are functions of tensors only, free of data-dependent Python control flow: routed experts
run on weights stacked once per MoE layer, so shapes never depend on the routing. As in vLLM, q_a_proj and
kv_a_proj_with_mqa run as one GEMM (``fused_qkv_a_proj``), and so do an MLP's gate and up projections
(``gate_up_proj``): each oneDNN call costs ~30 us on these sizes whatever its width. For a model of
layers 0..n-1 a step runs ``head``, then per layer i the attention and ``between(i)`` (layer i's
rest and layer i+1's projections), the last layer's rest being ``tail``. Numerics: the eager model's
operations, but fused kernels may round differently in the last bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.deepseek import DeepseekForCausalLM
from mlaq.model.layers.linear import fuse_rows, linear
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.model.layers.mla_flash import flash_output, flash_queries
from mlaq.model.layers.moe import DenseMLP, MoE
from mlaq.model.layers.mtp import MTPLayer, select_rows

# A layer's input to its attention: (x (B, T, H) the residual stream entering the layer, q the
# queries, latent (B, T, L+R) the new cache entries). q is mla_flash's folded form (B, 1, N*T, L+R)
# in the compute dtype, BMM #1 done, where the layer ``folds``; else [q_nope | q_pe] (B, T, N, P+R),
# q_pe rotated.
Projected = tuple[Tensor, Tensor, Tensor]


class _Experts(torch.nn.Module):
    """Routed experts' weights stacked: gate / up (E, I, H), down (E, H, I). Buffers of a module, so
    torch.compile treats them as the model's weights (frozen constants, guarded by identity) rather
    than as graph inputs whose shape and strides are checked on every call."""

    def __init__(self, gate: Tensor, up: Tensor, down: Tensor) -> None:
        super().__init__()
        self.register_buffer("gate", gate)
        self.register_buffer("up", up)
        self.register_buffer("down", down)


class _Fused(torch.nn.Module):
    """A layer's weights stacked for the pieces (``linear.fuse_rows``): ``qkv_a`` (q_a_proj over
    kv_a_proj_with_mqa) and ``gate_up`` (the dense MLP's or the shared experts' gate over up), or None.
    Buffers of a module, as ``_Experts``."""

    def __init__(self, qkv_a: Tensor | None, gate_up: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qkv_a", qkv_a)
        self.register_buffer("gate_up", gate_up)


class StepPieces:
    """The trace-friendly pieces of ``model``'s absorbed-path steps (main layers, and MTP layer 0)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        *,
        fold_bmms: bool = True,
        outside: frozenset[int] = frozenset(),
        fuse_linears: bool = True,
    ) -> None:
        """``fold_bmms=False``: every layer's BMMs stay outside the pieces (A/B measurements);
        ``outside``: layers whose BMMs the caller runs itself (mlaq's C kernel, ``mlaq.engine.compiled``);
        ``fuse_linears=False``: q_a / kv_a and gate / up as separate GEMMs (A/B measurements)."""
        for layer in model.model.layers:
            if layer.indexer_kind is not None:
                raise ValueError(
                    "compile=True supports models without a DSA indexer (DeepSeek-V2/V3, Kimi-K2, "
                    "GLM-4.7-Flash); run this model with compile=False"
                )
        self.model = model
        self.fold_bmms = fold_bmms
        self.outside = outside
        self.experts = [self._stacked(layer) for layer in model.model.layers]
        self.fused = [
            self._fused(layer) if fuse_linears else _Fused(None, None) for layer in model.model.layers
        ]

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

    @staticmethod
    def _fused(layer: DecoderLayer) -> _Fused:
        """vLLM's fused linears: one GEMM where two read the same input (fewer oneDNN calls a step; each
        costs ~30 us at batch 1 on these sizes). The model's weights become views of the stacked ones.
        gate / up also brings the pieces' MLPs to eager's bits: as separate GEMMs, inductor fused the SiLU
        into oneDNN's gate GEMM as a post-op on the float32 sums, before the bf16 rounding eager does first;
        split from the stacked GEMM's output, SiLU reads the rounded values (tests/test_engine_compiled.py)."""
        attn = layer.self_attn
        qkv_a = fuse_rows(attn.q_a_proj, attn.kv_a_proj_with_mqa) if attn.config.q_lora_rank else None
        mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
        gate_up = fuse_rows(mlp.gate_proj, mlp.up_proj) if isinstance(mlp, DenseMLP) else None
        return _Fused(qkv_a, gate_up)

    # ---- main layers --------------------------------------------------------------------------
    def head(self, input_ids: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Projected:
        """Token ids and positions (B, T), RoPE cos / sin (B, T, R) -> layer 0's input and projections."""
        return self._project(0, self.model.model.embed_tokens(input_ids), positions, cos, sin)

    def between(self, i: int, x: Tensor, o: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Projected:
        """Layer i's input x and attention output o -> layer i+1's input and projections. o is
        ``mla_flash.flash_attend``'s (B, 1, N*T, L+R) where layer i ``folds``, else (B, T, N, V)."""
        return self._project(i + 1, self._finish(i, x, o), positions, cos, sin)

    def tail(self, i: int, x: Tensor, o: Tensor, logits_index: Tensor | None) -> tuple[Tensor, Tensor]:
        """The last main layer's rest, the final norm and lm_head -> (logits fp32, hidden (B, T, H))."""
        m = self.model
        hidden = m.model.norm(self._finish(i, x, o))
        return m.lm_head(select_rows(hidden, logits_index)).float(), hidden

    # ---- MTP layer 0 (as MTPLayer.predict) ----------------------------------------------------
    def mtp_head(
        self, input_ids: Tensor, hidden: Tensor, positions: Tensor, cos: Tensor, sin: Tensor
    ) -> Projected:
        layer = self._mtp_layer()
        x = layer.combine(input_ids, hidden, self.model.model.embed_tokens)
        return self._project(layer.layer, x, positions, cos, sin)

    def mtp_tail(self, x: Tensor, o: Tensor, logits_index: Tensor | None) -> tuple[Tensor, Tensor]:
        """-> (logits fp32, the MTP layer's output hidden (B, T, H))."""
        layer = self._mtp_layer()
        y = self._finish(layer.layer, x, o)
        return layer.logits(y, self.model.lm_head, logits_index), y

    def _mtp_layer(self) -> MTPLayer:
        layer = self.model.model.layers[self.model.config.num_hidden_layers]
        assert isinstance(layer, MTPLayer)
        return layer

    # ---- one layer's halves -------------------------------------------------------------------
    def folds(self, i: int) -> bool:
        """Whether layer i's BMMs run inside the pieces: both its schemes compile exactly. Read while
        tracing and by the caller (``mlaq.engine.compiled``, which refuses weights prepared again)."""
        return self._folded_weights(i) is not None

    def _folded_weights(self, i: int) -> AbsorbedWeights | None:
        w = self.model.model.layers[i].self_attn.absorbed
        ok = w is not None and w.scheme_uk.compiles_exactly and w.scheme_uv.compiles_exactly
        return w if self.fold_bmms and ok and i not in self.outside else None

    def _project(self, i: int, x: Tensor, positions: Tensor, cos: Tensor, sin: Tensor) -> Projected:
        attn = self.model.model.layers[i].self_attn
        hidden = self.model.model.layers[i].input_layernorm(x)
        proj = attn.project(hidden, positions, (cos, sin), qkv_a=self.fused[i].qkv_a)
        w = self._folded_weights(i)
        if w is not None:
            return x, flash_queries(proj.q_nope, proj.q_pe, w), proj.latent
        return x, torch.cat((proj.q_nope, proj.q_pe), dim=-1), proj.latent

    def _finish(self, i: int, x: Tensor, o: Tensor) -> Tensor:
        """Layer i after its attention: (BMM #2,) o_proj, residual, post-attention norm, MLP / MoE,
        residual."""
        layer = self.model.model.layers[i]
        b, t = x.shape[:2]
        w = self._folded_weights(i)
        if w is not None:
            o = flash_output(o, w, layer.self_attn.config.num_heads, x.dtype)  # (B, T, N, V)
        x = x + layer.self_attn.o_proj(o.reshape(b, t, -1))  # (B, T, N*V) -> (B, T, H)
        h = layer.post_attention_layernorm(x)
        stacked, gate_up = self.experts[i], self.fused[i].gate_up
        if stacked is not None:
            return x + _moe(layer.mlp, stacked, h, gate_up)
        return x + (layer.mlp(h) if gate_up is None else layer.mlp(h, gate_up))


def _moe(moe: MoE, w: _Experts, x: Tensor, shared_gate_up: Tensor | None = None) -> Tensor:
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
        out = out + moe.shared_experts(flat, shared_gate_up)
    return out.view(shape)
