"""One decoder layer over whole teacher-forced windows, the way the in-memory model computes it, with
the attention split into query chunks so its (T, N, K) scores fit a memory budget.

Each window is one row starting at position 0 (validate's teacher forcing), so the layer's keys are
exactly the window's own new latent entries and no cache is needed; a task sample's tail (its query
and answer, decoded after its prefilled haystack) attends over the prefix's entries at that layer
followed by its own, which is what the in-memory cache holds. With ``chunk >= T`` every call
below is the very call the in-memory model makes (DecoderLayer._attention for the streams,
MLAttention.forward for the per-layer replay), so the results are bit-identical; smaller chunks run the
same arithmetic per query row (row-wise softmax, per-token activation scales), only in smaller matmuls.

Routed experts are applied across groups (one group = one stream's window): tokens grouped by expert
as MoE._grouped does, experts visited in ascending order, each expert's weights fetched once for all
groups through ``fetch_expert``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.mla import AttnPath, attention_mask
from mlaq.model.layers.moe import MoE
from mlaq.model.layers.step import StepPositions
from mlaq.model.registry import IndexerKind


@dataclass(frozen=True)
class AttentionResult:
    out: Tensor  # (B, T, H) attention output (o_proj's), compute dtype
    key_mask: Tensor | None  # (B, T, K) bool DSA selection this layer made, None without an indexer
    keys: Tensor  # (B, K, L+R) the latent keys attended over: the layer's cache after this call
    index_keys: Tensor | None  # (B, K, D) the DSA indexer's keys likewise (None without an indexer)


def _spans(t: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, t)) for a in range(0, t, chunk)]


@torch.no_grad()
def attention(
    layer: DecoderLayer,
    h: Tensor,
    step: StepPositions,
    shared_key_mask: Tensor | None,
    chunk: int,
    *,
    path: AttnPath = AttnPath.ABSORBED,
    prior: AttentionResult | None = None,
) -> AttentionResult:
    """``layer``'s attention on its normed input h (B, T, H) at ``step`` as DecoderLayer._attention
    computes it. Without ``prior`` the cache is empty (positions 0..T-1); with it, the cache holds
    ``prior.keys`` (and ``prior.index_keys``) for positions 0..S-1 and ``step`` starts at S (a task
    sample's query and answer decoded after its prefilled haystack)."""
    attn = layer.self_attn
    t = h.shape[1]
    proj = attn.project(h, step.positions, (step.cos, step.sin))
    # the cache written at the step's positions: exactly the prior entries followed by the new ones
    keys = proj.latent if prior is None else torch.cat((prior.keys, proj.latent), dim=1)  # (B, K, L+R)
    key_mask = index_keys = None
    indexer = layer.indexer
    if indexer is not None:
        assert proj.q_latent is not None
        index_keys = indexer.keys(h, step.positions)  # (B, T, D)
        if prior is not None:
            assert prior.index_keys is not None
            index_keys = torch.cat((prior.index_keys, index_keys), dim=1)  # (B, K, D)
        visible = step.visible()  # (B, T, K)
        parts = []
        for a, b in _spans(t, chunk):
            scores = indexer.scores(h[:, a:b], proj.q_latent[:, a:b], step.positions[:, a:b], index_keys)
            parts.append(indexer.select(scores, visible[:, a:b]))  # (B, b-a, K)
        key_mask = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    elif layer.indexer_kind is IndexerKind.SHARED:
        if shared_key_mask is None:
            raise ValueError(f"layer {layer.layer} shares DSA top-k but no earlier layer computed one")
        key_mask = shared_key_mask
    mask = step.with_key_mask(key_mask)
    out = _attend_chunks(attn, proj.q_nope, proj.q_pe, keys, mask, chunk, path)
    return AttentionResult(out, key_mask, keys, index_keys)


@torch.no_grad()
def replay(layer: DecoderLayer, h: Tensor, positions: Tensor, key_mask: Tensor | None, chunk: int) -> Tensor:
    """``layer``'s attention on a captured input h (1, T, H) under whatever BMM weights it holds, as
    validate's replay (MLAttention.forward, absorbed path) computes it -> (T, H) float32."""
    attn = layer.self_attn
    proj = attn.project(h.to(attn.dtype), positions)  # RoPE angles from positions, as forward does
    valid = torch.ones(positions.shape, dtype=torch.bool)  # every key 0..T-1 is a new entry
    mask = attention_mask(positions, valid, key_mask)
    return _attend_chunks(attn, proj.q_nope, proj.q_pe, proj.latent, mask, chunk, AttnPath.ABSORBED)[
        0
    ].float()


def _attend_chunks(
    attn, q_nope: Tensor, q_pe: Tensor, keys: Tensor, mask: Tensor | None, chunk: int, path: AttnPath
) -> Tensor:
    """attend() per query chunk; a chunk ending at query b sees keys 0..S+b-1 only (causality; S: the
    keys before the first query)."""
    t = q_nope.shape[1]
    if chunk >= t:
        return attn.attend(q_nope, q_pe, keys, mask, path)
    if mask is None:
        raise ValueError("chunked attention needs the causal mask")
    s = keys.shape[1] - t
    parts = [
        attn.attend(q_nope[:, a:b], q_pe[:, a:b], keys[:, : s + b], mask[:, a:b, : s + b], path)
        for a, b in _spans(t, chunk)
    ]
    return torch.cat(parts, dim=1)


@dataclass
class _Group:
    """One stream-window's tokens in MoE._grouped's order."""

    flat: Tensor  # (T, H)
    tokens: Tensor  # (T*k,) token of each (token, slot) pair, sorted by expert
    x: Tensor  # (T*k, H) their inputs
    w: Tensor  # (T*k, 1) routing weights
    counts: list[int]  # tokens per expert
    out: Tensor  # (T, H) routed output being accumulated
    start: int = 0


@torch.no_grad()
def moe_groups(
    mlps: Sequence[MoE],
    inputs: Sequence[Tensor],
    fetch_expert: Callable[[int, set[torch.dtype]], dict[torch.dtype, torch.nn.Module]],
) -> list[Tensor]:
    """MoE of each group: ``mlps[g]`` (routed experts unloaded) on ``inputs[g]`` (1, T, H). Every
    expert some group routes to is fetched once (``fetch_expert(e, dtypes)``) and applied to each
    group's tokens, in ascending expert order as MoE._grouped does."""
    groups = []
    for mlp, x in zip(mlps, inputs, strict=True):
        flat = x.reshape(-1, x.shape[-1])  # (T, H)
        weights, indices = mlp.gate(flat)  # (T, k) fp32, (T, k)
        k = indices.shape[1]
        choices = indices.reshape(-1)
        order = torch.argsort(choices, stable=True)
        counts = torch.bincount(choices, minlength=mlp.cfg.n_routed_experts).tolist()
        tokens = order // k
        groups.append(
            _Group(
                flat, tokens, flat[tokens], weights.reshape(-1)[order, None], counts, torch.zeros_like(flat)
            )
        )
    n_experts = len(groups[0].counts) if groups else 0
    for expert in range(n_experts):
        users = [g for g in groups if g.counts[expert]]
        if not users:
            continue
        modules = fetch_expert(expert, {g.flat.dtype for g in users})
        for g in users:
            n, s = g.counts[expert], g.start
            y = modules[g.flat.dtype](g.x[s : s + n])  # (n, H)
            g.out.index_add_(0, g.tokens[s : s + n], (y * g.w[s : s + n]).to(g.out.dtype))
            g.start += n
        del modules
    outs = []
    for mlp, g, x in zip(mlps, groups, inputs, strict=True):
        out = g.out
        if mlp.shared_experts is not None:
            out = out + mlp.shared_experts(g.flat)
        outs.append(out.view(x.shape))
    return outs
