"""Capture what each MLA layer's attention sees under the reference, then replay it under any variant.

Per window, the reference run (absorbed MLA over the whole window: query length T, causal mask)
records every layer's attention input, i.e. ``input_layernorm``'s output, and the DSA key mask it used
(None without an indexer); the MTP layer(s) run teacher-forced on the same window (position t reads the
target's hidden state h_t and token t+1). Replaying a layer's attention on those SAME inputs under a
variant isolates that layer's error from the drift of everything before it. The same reference run
also records each layer's attention output (o_proj's) and the activations each absorbed BMM receives
(q_nope for BMM #1, the latent attention output for BMM #2, through a pass-through scheme) for the
per-op error against theory. Replaying the reference itself reproduces its outputs bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.model import AttnPath, DeepseekForCausalLM, ModelCache
from mlaq.model.layers.mla_core import assemble_keys, attention_mask


@dataclass
class LayerInput:
    """The attention input of one layer (main or MTP) on one window, under the reference."""

    layer: int  # checkpoint index (MTP layers: num_hidden_layers + i)
    mtp: bool
    hidden: Tensor  # (1, T', H) input_layernorm output, reference dtype
    positions: Tensor  # (1, T') int64
    key_mask: Tensor | None  # (1, T', K) bool: the DSA selection the layer used, None without indexer
    ref_out: Tensor  # (T', H) float32 attention output under the reference
    # (N, T', P), (N, T', L) float32: what the reference's BMMs got; None once the per-op figures,
    # their only reader, are done (they are 160 MiB per layer at 16,384 tokens)
    bmm_inputs: tuple[Tensor, Tensor] | None


@dataclass(frozen=True)
class ReferenceWindow:
    """The reference's view of one window: log-probabilities and every layer's attention input."""

    logprobs: Tensor  # (T, V) float32 log-softmax of the main model's logits
    layers: tuple[LayerInput, ...]


@torch.no_grad()
def capture_reference(model: DeepseekForCausalLM, ids: Tensor) -> ReferenceWindow:
    """Run the reference over ``ids`` (1, T) with the absorbed path; capture every layer's attention
    input, key mask, output (o_proj's) and the activations of both BMMs, in that one run."""
    seen: dict[int, dict[str, Any]] = {}
    handles = []
    saved = {}
    for layer in model.model.layers:
        index = layer.layer
        seen[index] = {}

        def norm_hook(_m, _args, out, store=seen[index]):  # out: (1, T', H)
            store["hidden"] = out.detach()

        def layer_hook(_m, args, out, store=seen[index]):  # args: (x, positions, ...); out[2]: key mask
            store["positions"] = args[1].detach()
            store["key_mask"] = out[2]

        def out_hook(_m, _args, out, store=seen[index]):  # the attention output (1, T', H)
            store["ref_out"] = out[0].float()

        attn = layer.self_attn
        handles.append(layer.input_layernorm.register_forward_hook(norm_hook))
        handles.append(layer.register_forward_hook(layer_hook))
        handles.append(attn.o_proj.register_forward_hook(out_hook))
        ab = attn.absorbed
        if ab is None:
            raise ValueError(f"layer {index}: absorbed BMM weights are not prepared")
        saved[index] = ab
        seen[index]["rec"] = (_Recording(ab.scheme_uk), _Recording(ab.scheme_uv))
        attn.set_absorbed(
            ab.w_uk, ab.w_uv, seen[index]["rec"][0], scheme_uv=seen[index]["rec"][1], precision=ab.precision
        )
    try:
        out = model(ids, ModelCache(), path=AttnPath.ABSORBED)
        hidden = out.hidden  # (1, T, H)
        for step in range(model.num_mtp_layers):  # chained MTP layers, each one token further ahead
            shift = step + 1
            if ids.shape[1] <= shift:
                break
            mtp = model.mtp_step(
                ids[:, shift:], hidden[:, :-1], ModelCache(), step=step, path=AttnPath.ABSORBED
            )
            hidden = mtp.hidden
    finally:
        for h in handles:
            h.remove()
        for layer in model.model.layers:
            ab = saved[layer.layer]
            layer.self_attn.set_absorbed(
                ab.w_uk, ab.w_uv, ab.scheme_uk, scheme_uv=ab.scheme_uv, precision=ab.precision
            )
    n_main = model.config.num_hidden_layers
    layers = []
    for i, s in sorted(seen.items()):
        if "hidden" not in s:  # an MTP layer the window was too short for
            continue
        rec_uk, rec_uv = s["rec"]
        layers.append(
            LayerInput(
                i,
                i >= n_main,
                s["hidden"],
                s["positions"],
                s["key_mask"],
                s["ref_out"],
                (rec_uk.inputs[0], rec_uv.inputs[0]),
            )
        )
    return ReferenceWindow(torch.log_softmax(out.logits[0].float(), dim=-1), tuple(layers))


class _Recording(BmmScheme):
    """Pass-through wrapper that keeps the activations a scheme is applied to."""

    def __init__(self, inner: BmmScheme) -> None:
        self.inner = inner
        self.name = inner.name
        self.description = inner.description
        self.inputs: list[Tensor] = []

    def prepare(self, weight: Tensor) -> PreparedWeight:
        return self.inner.prepare(weight)

    def apply(self, x: Tensor, prepared: PreparedWeight) -> Tensor:
        self.inputs.append(x.detach().float())
        return self.inner.apply(x, prepared)


@dataclass(frozen=True)
class ProjectedInput:
    """A captured layer input through the layer's query and latent-key projections, which do not
    depend on the BMM scheme: computed once per model and window, replayed under every scheme."""

    layer: int
    q_nope: Tensor  # (1, T', N, P) compute dtype
    q_pe: Tensor  # (1, T', N, R), rotated
    keys: Tensor  # (1, K, L+R) latent keys by position
    valid: Tensor  # (1, K) bool: which key positions hold an entry

    def mask(self, inp: LayerInput) -> Tensor:
        """(1, T', K) bool: causal, and the captured DSA selection. Built when the replay runs and
        dropped after it: T' x K bytes (256 MiB at 16,384 tokens) per layer and model if it were kept."""
        return attention_mask(inp.positions, self.valid, inp.key_mask)


@torch.no_grad()
def project_input(model: DeepseekForCausalLM, inp: LayerInput) -> ProjectedInput:
    """What ``MLAttention.forward`` computes before ``attend`` (but the mask), for layer ``inp.layer``."""
    attn = model.model.layers[inp.layer].self_attn
    proj = attn.project(inp.hidden.to(attn.dtype), inp.positions)
    keys, valid = assemble_keys(None, None, proj.latent, inp.positions)  # (1, K, L+R), (1, K)
    return ProjectedInput(inp.layer, proj.q_nope, proj.q_pe, keys, valid)


@torch.no_grad()
def attention_output(
    model: DeepseekForCausalLM, inp: LayerInput, projected: ProjectedInput | None = None
) -> Tensor:
    """Layer ``inp.layer``'s attention (absorbed path, query length T', causal) on the captured input,
    under whatever BMM weights the model's layer holds -> (T', H) float32. ``projected``: the input
    already projected by this same model (``project_input``), reused across schemes."""
    attn = model.model.layers[inp.layer].self_attn
    p = project_input(model, inp) if projected is None else projected
    if p.layer != inp.layer or p.q_nope.dtype != attn.dtype:
        raise ValueError(
            f"projected input of layer {p.layer} ({p.q_nope.dtype}) replayed on layer {inp.layer}"
        )
    out = attn.attend(p.q_nope, p.q_pe, p.keys, p.mask(inp), AttnPath.ABSORBED)  # (1, T', H)
    return out[0].float()
