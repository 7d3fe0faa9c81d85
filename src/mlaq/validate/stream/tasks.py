"""The long-context task suite of a streamed run, layer-major, as tasks/scoring.py runs it in memory.

In memory each batch of equal-length samples is prefilled up to its first query (naive MLA: the
decompressed cache), then its query and answer are decoded teacher-forced (absorbed MLA: both BMMs
with the variant's scheme), and the answer tokens are scored from the tail's log-probabilities. Here
every batch's prefix and each variant's tail are hidden states carried from layer to layer beside the
validation windows: at layer i the prefix runs its attention (its new latent and indexer keys are the
layer's cache), each variant's tail attends over that cache plus its own entries, then prefix and tails
go through the layer's MLP with the windows (each routed expert read once); after the last main layer
the tails meet the head and are scored. Variants share a prefix exactly when the engine shares its
prefill: under ``decode_only`` the naive path does not use the scheme (one prefix per loaded model),
under ``consistent`` and ``absorbed`` it does (one per scheme).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mlaq.model import Precision
from mlaq.model.layers.decoder import DecoderLayer
from mlaq.model.layers.linear import linear
from mlaq.model.layers.mla import AttnPath
from mlaq.model.layers.mla_core import AbsorbedWeights
from mlaq.model.layers.rope import RopeTable
from mlaq.model.layers.step import StepPositions, step_positions
from mlaq.validate.config import Variant, VariantKind
from mlaq.validate.stream.layer_exec import AttentionResult, attention
from mlaq.validate.tasks.generators import TaskSample
from mlaq.validate.tasks.scoring import SampleScore, batches, score_rows


@dataclass
class Hidden:
    """One batch's hidden states in one compute dtype, carried from layer to layer."""

    dtype: torch.dtype
    x: Tensor  # (B, T', H)
    shared_mask: Tensor | None = None  # the last full DSA layer's selection (GLM-5 shared layers)
    cache: AttentionResult | None = None  # a prefix's entries at the current layer, while tails read them


@dataclass
class _Batch:
    samples: list[TaskSample]
    index: list[int]  # their positions in the suite's sample list
    decode_from: int  # the prefix is ids[:decode_from], the tail ids[decode_from:]
    prefix_step: StepPositions
    tail_step: StepPositions
    prefixes: dict[Hashable, Hidden] = field(default_factory=dict)
    tails: dict[Variant, Hidden] = field(default_factory=dict)


class TaskStreams:
    """The suite's samples under ``variants`` (the reference first), batched as the engine batches them."""

    def __init__(
        self,
        samples: Sequence[TaskSample],
        variants: Sequence[Variant],
        precision: Precision,
        batch_tokens: int,
        rope: RopeTable,
        embed: Callable[[Tensor], dict[torch.dtype, Tensor]],
    ) -> None:
        """``embed(ids)`` (B, T) -> the embedded tokens (B, T, H) in each compute dtype."""
        self.variants, self.precision = list(variants), precision
        self.count = len(samples)
        self.first: dict[Hashable, Variant] = {}  # the variant whose model prefills each prefix
        for v in self.variants:
            self.first.setdefault(self.prefix_key(v), v)
        self.batches: list[_Batch] = []
        for idx in batches(samples, batch_tokens):
            group = [samples[i] for i in idx]
            d = min(s.query_start for s in group)
            t = group[0].length
            ids = torch.tensor([s.ids for s in group])  # (B, T)
            b = _Batch(
                group,
                idx,
                d,
                step_positions((0,) * len(group), d, rope),
                step_positions((d,) * len(group), t - d, rope),
            )
            embedded = embed(ids)
            for key, v in self.first.items():
                b.prefixes[key] = Hidden(v.dtype, embedded[v.dtype][:, :d])
            for v in self.variants:
                b.tails[v] = Hidden(v.dtype, embedded[v.dtype][:, d:])
            self.batches.append(b)
        self.scores: dict[Variant, list[SampleScore | None]] = {v: [None] * self.count for v in self.variants}

    def prefix_key(self, v: Variant) -> Hashable:
        """Which prefill ``v`` decodes from: the engine's (one model per dtype, another for as-configured;
        the scheme too unless the naive path ignores it)."""
        model = "as-configured" if v.kind is VariantKind.AS_CONFIGURED else v.dtype
        return model, None if self.precision is Precision.DECODE_ONLY else v.scheme

    @torch.no_grad()
    def attention(
        self,
        modules: dict[torch.dtype, DecoderLayer],
        prepare: Callable[[Variant], AbsorbedWeights],
        chunk: int,
    ) -> None:
        """Attention (plus residual) of every prefix, then of every variant's tails, at this layer;
        ``prepare(v)`` gives the layer v's BMM weights (once per variant, for all batches)."""
        for key, v in self.first.items():
            prepare(v)  # under consistent the naive path decompresses with the scheme's weights
            mod = modules[v.dtype]
            for b in self.batches:
                _step(mod, b.prefixes[key], b.prefix_step, chunk, AttnPath.NAIVE, None)
        for v in self.variants:
            prepare(v)
            mod = modules[v.dtype]
            for b in self.batches:
                prior = b.prefixes[self.prefix_key(v)].cache
                _step(mod, b.tails[v], b.tail_step, chunk, AttnPath.ABSORBED, prior)
        for b in self.batches:
            for h in b.prefixes.values():
                h.cache = None

    def hidden(self, prefixes: bool) -> list[Hidden]:
        """The hidden states the MLP stage updates (``prefixes=False`` after the last layer's attention:
        only the tails go on to the head)."""
        out = []
        for b in self.batches:
            out += [*(b.prefixes.values() if prefixes else ()), *b.tails.values()]
        return out

    @torch.no_grad()
    def head(self, norms: dict[torch.dtype, torch.nn.Module], heads: dict[torch.dtype, Tensor]) -> None:
        """Final norm, lm_head and the scores of every tail; frees every hidden state."""
        for b in self.batches:
            b.prefixes.clear()
            for v, h in b.tails.items():
                logits = linear(norms[h.dtype](h.x), heads[h.dtype]).float()  # (B, T - d, V)
                scores = score_rows(torch.log_softmax(logits, dim=-1), b.samples, b.decode_from)
                for i, sc in zip(b.index, scores, strict=True):
                    self.scores[v][i] = sc
                del logits
            b.tails.clear()

    def results(self, v: Variant) -> list[SampleScore]:
        out = self.scores[v]
        if any(s is None for s in out):
            raise RuntimeError("task scores read before the head stage ran")
        return [s for s in out if s is not None]


def task_shape(drawn, variants: Sequence[Variant], precision: Precision) -> dict[str, int]:
    """What the planner needs to know about the suite (``drawn``: tasks.run.Drawn or None): its tokens,
    the longest sample, the largest batch, and the bytes of its hidden states per hidden unit (every
    prefix copy over the prefix tokens, every variant's tail over the tail tokens)."""
    if drawn is None:
        return {}
    samples = drawn.samples
    groups = [[samples[i] for i in idx] for idx in batches(samples, drawn.suite.batch_tokens)]
    model = {v: "as-configured" if v.kind is VariantKind.AS_CONFIGURED else v.dtype for v in variants}
    keys = {(model[v], None if precision is Precision.DECODE_ONLY else v.scheme): v.dtype for v in variants}
    size = {v.dtype: torch.empty((), dtype=v.dtype).element_size() for v in variants}
    prefix = sum(len(g) * min(s.query_start for s in g) for g in groups)
    tail = sum(s.length for s in samples) - prefix
    return {
        "task_tokens": sum(s.length for s in samples),
        "task_len": max(s.length for s in samples),
        "task_batch": max(len(g) for g in groups),
        "task_hidden": prefix * sum(size[d] for d in keys.values())
        + tail * sum(size[v.dtype] for v in variants),
    }


def _step(
    mod: DecoderLayer,
    h: Hidden,
    step: StepPositions,
    chunk: int,
    path: AttnPath,
    prior: AttentionResult | None,
) -> None:
    res = attention(mod, mod.input_layernorm(h.x), step, h.shared_mask, chunk, path=path, prior=prior)
    h.x = h.x + res.out
    if res.key_mask is not None:
        h.shared_mask = res.key_mask
    if path is AttnPath.NAIVE:  # keep the layer's cache for the tails, not the output
        h.cache = AttentionResult(res.out[:, :0], None, res.keys, res.index_keys)
