"""The MLP and head stages of a streamed run (runner.py drives them layer by layer).

MLP: every stream's windows and the task samples' hidden states through the layer's post-attention
norm and MLP; inside an MoE layer each routed expert is read once for all of them (layer_exec.moe_groups).
Head: the final norm and lm_head per window and position chunk -> KL / top-1 / ΔNLL against the
reference, and the task samples' answer scores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.model.layers.linear import linear
from mlaq.model.loading.layer_source import LayerSource
from mlaq.validate.metrics import divergence
from mlaq.validate.stream.layer_exec import moe_groups
from mlaq.validate.stream.streams import Stream
from mlaq.validate.stream.tasks import Hidden, TaskStreams


def embedded(source: LayerSource, ids: Tensor, dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, Tensor]:
    """The embedding of ``ids`` (B, T) in each dtype, as the model's embed_tokens computes it."""
    rows, remapped = source.embedding_rows("model.embed_tokens.weight", ids)
    return {dt: rows.to(dt)[remapped] for dt in dtypes}


def mlp_stage(
    source: LayerSource,
    index: int,
    modules,
    streams: Sequence[Stream],
    clock: list[float] | None = None,
    extra: Sequence[Hidden] = (),
) -> int:
    """Post-attention norm and MLP (plus residual) for every stream and window and the ``extra`` hidden
    states (the task samples'); returns the routed experts read (each once for all of them)."""
    keys = [(s, w) for s in streams for w in range(len(s.x))]
    items = [Hidden(s.variant.dtype, s.x[w]) for s, w in keys] + list(extra)
    normed = [modules[h.dtype].post_attention_layernorm(h.x) for h in items]
    if not source.is_moe(index):
        outs = [modules[h.dtype].mlp(x) for h, x in zip(items, normed, strict=True)]
        read = 0
    else:
        count = [0]

        def fetch(expert: int, dtypes: set[torch.dtype]):
            count[0] += 1
            start = time.perf_counter()
            modules = source.expert(index, expert, sorted(dtypes, key=str))
            if clock is not None:
                clock[0] += time.perf_counter() - start
            return modules

        mlps = [modules[h.dtype].mlp for h in items]
        outs = moe_groups(mlps, normed, fetch)
        read = count[0]
    del normed
    for h, y in zip(items, outs, strict=True):
        h.x = h.x + y
    for (s, w), h in zip(keys, items[: len(keys)], strict=True):
        s.x[w] = h.x
    return read


def head_stage(
    source: LayerSource,
    streams: Sequence[Stream],
    ids: Tensor,
    dtypes: list[torch.dtype],
    chunk: int,
    tasks: TaskStreams | None = None,
) -> list[Tensor]:
    """Final norm, lm_head and the teacher-forced comparison per window and position chunk (and the task
    samples' scores). Returns the reference's final hidden states (what the MTP layer consumes); frees
    every stream's."""
    norms, heads = source.norm(dtypes), source.head(dtypes)
    if tasks is not None:
        tasks.head(norms, heads)
    ref, others = streams[0], streams[1:]
    t = ids.shape[1]
    final_ref = []
    for w in range(ids.shape[0]):
        hidden = {s.variant: norms[s.variant.dtype](s.x[w]) for s in streams}  # (1, T, H)
        final_ref.append(hidden[ref.variant])
        for a in range(0, t, chunk):
            b = min(a + chunk, t)
            e = min(b + 1, t)  # one row more: the NLL of row b-1 needs target b, and KL counts [a, b)
            targets = ids[w, a + 1 : e]
            ref_lp = torch.log_softmax(
                linear(hidden[ref.variant][0, a:e], heads[ref.variant.dtype]).float(), dim=-1
            )
            pos = torch.arange(a, b)
            nll = -ref_lp[: len(targets)].gather(1, targets[:, None])[:, 0]
            ref.sums[w].add("nll", torch.arange(a, a + len(targets)), nll)
            for s in others:
                logits = linear(hidden[s.variant][0, a:e], heads[s.variant.dtype]).float()
                d = divergence(ref_lp, logits, targets)
                s.sums[w].add("kl", pos, d.kl[: b - a])
                s.sums[w].add("top1", pos, d.top1[: b - a])
                s.sums[w].add("nll_delta", torch.arange(a, a + len(targets)), d.nll_delta)
        for s in streams:
            s.x[w] = s.x[w][:, :0]  # the hidden states are no longer needed
    return final_ref
