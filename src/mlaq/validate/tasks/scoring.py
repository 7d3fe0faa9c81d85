"""Scoring through the engine's model: the haystack prefilled, the query and answer decoded.

As an engine runs a prompt, each sample's context up to its query is prefilled (naive MLA: the
decompressed cache, kv_b_proj at the checkpoint's precision under ``decode_only``), and the query and
answer tokens then run on the decode path (absorbed MLA: both BMMs with the variant's scheme, every
layer), teacher-forced, so each answer token is read against the whole latent cache through the
scheme — the reads whose noise grows with the number of competing keys.

Two scores per sample (the answer has A tokens; position i is predicted from the tokens before it):
- exact match: every answer token is the argmax of its position. This is exactly "greedy decoding
  reproduces the answer": greedy's prefix equals the answer for as long as the argmaxes agree;
- mean log-probability of the answer tokens, in nats (continuous, far more sensitive than accuracy);
- token accuracy: the share of answer tokens that are their position's argmax.
``score_answer`` is the one scorer: the layer-streamed run (stream/tasks.py) and live servers
(server/tasks.py) score through it too.
Under ``decode_only`` (vLLM's precision: the prefill runs kv_b_proj as the checkpoint stores it) the
prefill does not depend on the scheme, so it runs once per batch of samples and every scheme decodes
from it (the cache is truncated back after each): N schemes cost one prefill plus N short decodes. The
prefill only fills the cache (``prefill_cache``): the decode reads nothing else, so the last layer's
attention and MLP over the context are skipped, a quarter of a 4-layer model's prefill, bits unchanged.
Where the decode's GEMMs run in float32 (``native_low_precision_gemm``), the cache is converted to float32
once after the prefill (exact) rather than by every scheme's every layer: bits unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from itertools import groupby
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mlaq.validate.record import TaskScoreRecord
from mlaq.validate.tasks.generators import TaskSample

if TYPE_CHECKING:
    from mlaq.model import ModelCache

SampleScore = TaskScoreRecord  # correct (greedy exact match), logprob (mean, nats), token_accuracy


def score_answer(
    sample: TaskSample, logprobs: Tensor, argmax: Tensor, greedy: Sequence[int] | None = None
) -> TaskScoreRecord:
    """The task suite's one scorer, whatever measured the answer (the engine, a stream, a server).

    ``logprobs`` (A,): each answer token's log-probability given everything before it, teacher-forced;
    ``argmax`` (A,): each of those positions' most likely token. Exact match is "greedy decoding
    reproduces the answer": ``greedy``, the tokens a server generated, when given; else every answer
    token is its position's argmax (greedy's prefix equals the answer for as long as they agree)."""
    hits = argmax == torch.tensor(sample.answer)
    correct = tuple(greedy) == tuple(sample.answer) if greedy is not None else bool(hits.all())
    return TaskScoreRecord(correct, float(logprobs.mean()), float(hits.double().mean()))


def batches(samples: Sequence[TaskSample], batch_tokens: int) -> list[list[int]]:
    """Indices of ``samples`` grouped by length, then chunked to at most ``batch_tokens`` tokens."""
    out: list[list[int]] = []
    order = sorted(range(len(samples)), key=lambda i: samples[i].length)
    for length, group in groupby(order, key=lambda i: samples[i].length):
        idx = list(group)
        size = max(1, batch_tokens // length)
        out += [idx[i : i + size] for i in range(0, len(idx), size)]
    return out


@torch.no_grad()
def score_batch(
    model: torch.nn.Module, samples: Sequence[TaskSample], cache: ModelCache, decode_from: int
) -> list[SampleScore]:
    """Decode the tails ``ids[decode_from:]`` of equal-length ``samples`` after ``cache`` (holding their
    first ``decode_from`` tokens), score the answers, and truncate the cache back."""
    ids = torch.tensor([s.ids for s in samples])  # (B, T)
    tail = ids[:, decode_from:]  # (B, T - decode_from)
    try:
        logits = model.decode(tail, cache).logits  # (B, T - decode_from, V)
    finally:
        cache.truncate(decode_from)
    return score_rows(torch.log_softmax(logits.float(), dim=-1), samples, decode_from)


def score_rows(logprobs: Tensor, samples: Sequence[TaskSample], decode_from: int) -> list[SampleScore]:
    """The scores of equal-length ``samples`` from the log-probabilities (B, T - decode_from, V) of
    their tails ``ids[decode_from:]`` (row i predicts the token after tail token i)."""
    out = []
    for b, s in enumerate(samples):
        n = len(s.answer)
        start = len(s.prompt) - 1 - decode_from  # the tail row that predicts the first answer token
        rows = logprobs[b, start : start + n]  # (A, V)
        out.append(score_answer(s, rows.gather(1, torch.tensor(s.answer)[:, None]), rows.argmax(-1)))
    return out


@torch.no_grad()
def score_variants(
    samples: Sequence[TaskSample],
    variants: Sequence[Hashable],
    model_of: Callable[[Hashable], torch.nn.Module],
    prefill_key: Callable[[Hashable], Hashable],
    *,
    batch_tokens: int = 4096,
    on_batch: Callable[[int, int], None] | None = None,
) -> dict[Hashable, list[SampleScore]]:
    """Scores of every sample under every variant (in ``samples`` order).

    ``model_of(v)``: the model with v's BMMs prepared; ``prefill_key(v)``: variants with equal keys share
    one prefill (same model object and the same naive-path weights). Batch by batch: each distinct key
    prefills the batch's contexts once, every variant of that key decodes its query and answer from that
    cache (truncated back after each), and the cache is dropped before the next batch, so memory holds
    one batch's cache whatever the number of samples and variants. ``on_batch(done, total)`` reports."""
    from mlaq.model import ModelCache
    from mlaq.model.layers.linear import native_low_precision_gemm

    groups = batches(samples, batch_tokens)
    keys: dict[Hashable, list[Hashable]] = {}
    for v in variants:
        keys.setdefault(prefill_key(v), []).append(v)
    result: dict[Hashable, list[SampleScore | None]] = {v: [None] * len(samples) for v in variants}
    for g, idx in enumerate(groups):
        group = [samples[i] for i in idx]
        decode_from = min(s.query_start for s in group)
        ids = torch.tensor([s.ids[:decode_from] for s in group])  # (B, decode_from)
        for sharing in keys.values():
            if g % 2:  # snake order: the scheme the last batch ended with prefills and decodes first
                sharing = sharing[::-1]
            cache = ModelCache()
            model_of(sharing[0]).prefill_cache(ids, cache)  # the cache only: no last-layer outputs
            if not native_low_precision_gemm():  # the decodes multiply in float32: convert once, exactly
                cache.hold_latents(torch.float32)
            for v in sharing:
                for i, sc in zip(idx, score_batch(model_of(v), group, cache, decode_from), strict=True):
                    result[v][i] = sc
            del cache
        if on_batch is not None:
            on_batch(g + 1, len(groups))
    return {v: [s for s in out if s is not None] for v, out in result.items()}
