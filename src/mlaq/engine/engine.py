"""The engine step: schedule, run the model, sample (or draft with MTP and verify), emit deltas.

Speculative decoding with MTP, per running sequence of N tokens (main cache holds positions
0..N-2; the last token is not yet processed):
1. catch up the MTP layer's cache with the target hidden states of the positions the last
   verification accepted (MTP at position p reads h_p and token p+1) and take its argmax as
   draft 1; chain the MTP layer on its own hidden state for drafts 2..k (vLLM's MTP proposer);
2. verify [last token, d_1..d_k] in ONE target pass (absorbed MLA, query length k+1);
3. ``rejection_sample`` keeps the accepted prefix plus one target token; the cache is rolled
   back to the accepted positions; the metrics observe (k, accepted).
Under greedy sampling the emitted tokens are exactly plain greedy decoding's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.config import SpeculativeConfig
from mlaq.engine.detokenizer import IncrementalDetokenizer
from mlaq.engine.kv_cache import KVCacheDtype, LatentCacheConfig, LatentKVCache
from mlaq.engine.model_api import LatentLM
from mlaq.engine.outputs import CompletionOutput, RequestOutput
from mlaq.engine.penalties import adjusted_logits
from mlaq.engine.rejection import rejection_sample
from mlaq.engine.runner import ModelRunner
from mlaq.engine.sampler import processed_logits, sample
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.scheduler import Scheduler, SchedulerConfig
from mlaq.engine.sequence import FinishReason, check_stop_token
from mlaq.engine.sequence import Sequence as Seq
from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings, with vLLM's names."""

    max_model_len: int = 2048
    max_num_seqs: int = 16
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: room for max_num_seqs sequences of max_model_len
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO  # or "auto" / "fp8_e4m3" / "fp8"
    kv_cache_scale: float = 1.0  # per-tensor fp8 scale (vLLM's default)
    speculative_config: SpeculativeConfig | None = None  # or its dict / JSON text
    seed: int = 0  # seeds the generators of requests without their own seed
    max_position_embeddings: int | None = (
        None  # the model's context, for advice on a prompt that does not fit
    )
    max_num_batched_tokens: int | None = None  # prompt tokens prefilled in one step; None: max_model_len

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", KVCacheDtype.parse(self.kv_cache_dtype))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative_config is None else self.speculative_config.num_speculative_tokens

    @property
    def num_blocks(self) -> int:
        per_seq = -(-self.max_model_len // self.block_size)
        return self.num_kv_blocks or self.max_num_seqs * per_seq


@dataclass(eq=False)
class Request:
    """Engine-side state of one request around its ``Sequence``."""

    seq: Seq
    prompt: str | None
    detok: IncrementalDetokenizer | None
    stats: SpecDecodingStats | None
    pending_hidden: Tensor | None = None  # target hidden states the MTP cache has not seen yet
    cumulative_logprob: float = 0.0
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # sent once, with the first delta
    spec_steps: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) per step


class LLMEngine:
    """Continuous-batching generation over a ``LatentLM``; ``step()`` returns this step's deltas."""

    def __init__(
        self,
        model: LatentLM,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        g = model.geometry
        self.k = config.num_speculative_tokens
        if self.k and g.num_mtp_layers == 0:
            raise ValueError(
                'speculative_config {"method": "mtp"} needs the checkpoint\'s MTP layer, but this model has none '
                "(num_nextn_predict_layers = 0 or no model.layers.<num_hidden_layers>.* weights)"
            )
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        blocks = BlockManager(config.num_blocks, config.block_size, config.max_model_len)
        cache_config = LatentCacheConfig(
            g.num_layers + (1 if self.k else 0),  # one MTP layer drafts (chained k times)
            g.kv_lora_rank,
            g.qk_rope_head_dim,
            config.num_blocks,
            config.block_size,
            g.dtype,
            config.kv_cache_dtype,
            config.kv_cache_scale,
            tuple(g.extra_dim(i) for i in range(g.num_layers + (1 if self.k else 0))),
        )
        sched = SchedulerConfig(
            config.max_num_seqs,
            config.max_model_len,
            num_lookahead_slots=self.k,
            max_num_batched_tokens=config.max_num_batched_tokens,
        )
        self.scheduler = Scheduler(sched, blocks)
        self.runner = ModelRunner(model, LatentKVCache(cache_config), blocks, use_mtp=bool(self.k))
        self._seeds = torch.Generator().manual_seed(config.seed)
        self._requests: dict[int, Request] = {}
        self._next_id = 0
        self.spec_decoding_stats = SpecDecodingStats.new(self.k) if self.k else None

    # -- requests -------------------------------------------------------------------------------
    def add_request(
        self, prompt_token_ids: Sequence[int], params: SamplingParams, prompt: str | None = None
    ) -> str:
        """Queue a request; returns its id. A prompt that can never fit is rejected here."""
        vocab = self.model.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(
                f"token_id(s) {bad[:5]} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop_token_ids instead")
        seed = (
            params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
        )
        seq = Seq(
            self._next_id, [int(t) for t in prompt_token_ids], params, torch.Generator().manual_seed(seed)
        )
        if len(seq.prompt_token_ids) > self.config.max_model_len:
            raise ValueError(_too_long(len(seq.prompt_token_ids), self.config))
        self.scheduler.add(seq)
        detok = (
            IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params) if self.tokenizer else None
        )
        stats = SpecDecodingStats.new(self.k) if self.k else None
        self._requests[seq.seq_id] = Request(seq, prompt, detok, stats)
        self._next_id += 1
        return str(seq.seq_id)

    def abort(self, request_id: str) -> bool:
        """Drop a request now (between steps) and free its cache blocks; False if it is not here."""
        r = self._requests.pop(int(request_id), None) if request_id.isdigit() else None
        if r is None:
            return False
        self.scheduler.abort(r.seq)
        r.seq.finish(FinishReason.ABORT)
        if not self._requests:
            self.runner.release()
        return True

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV cache pool's blocks in use, in [0, 1] (vLLM's kv_cache_usage_perc)."""
        blocks = self.scheduler.blocks
        return 1.0 - blocks.num_free_blocks / blocks.num_blocks

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        reqs = [self._requests[s.seq_id] for s in batch.seqs]
        if batch.is_prefill:
            self._prefill(reqs)
        elif self.k:
            self._speculate(reqs)
        else:
            self._decode(reqs)
        outputs = [self._delta(r) for r in reqs]
        for seq in self.scheduler.finish_done():
            del self._requests[seq.seq_id]
        if not self._requests:
            self.runner.release()  # idle: no resident buffer held between batches
        return outputs

    def _prefill(self, reqs: list[Request]) -> None:
        seqs = [r.seq for r in reqs]
        tokens = [s.all_token_ids for s in seqs]  # prompt (+ outputs after a preemption)
        # prompt logprobs need every position's logits; only on a request's first prefill
        want = [r.seq.params.prompt_logprobs is not None and not r.seq.output_token_ids for r in reqs]
        out = self.runner.forward(seqs, tokens, prefill=True, last_only=not any(want))
        last = torch.tensor([len(t) - 1 for t in tokens]) if any(want) else -1
        logits = out.logits[torch.arange(len(reqs)), last]  # (B, V): each prompt's last token
        for row, (r, s) in enumerate(zip(reqs, seqs, strict=True)):
            s.num_cached = s.num_tokens
            r.pending_hidden = out.hidden[row, : len(tokens[row])] if self.k else None
            if want[row]:
                r.prompt_logprobs = [
                    None,
                    *_logprob_entries(
                        out.logits[row, : len(tokens[row]) - 1], tokens[row][1:], s.params.prompt_logprobs
                    ),
                ]
        # max_tokens=0: the prompt only (its logprobs), nothing generated
        done = [r for r in reqs if r.seq.params.max_tokens == 0]
        for r in done:
            r.seq.finish(FinishReason.LENGTH)
        keep = [row for row, r in enumerate(reqs) if r.seq.params.max_tokens != 0]
        if keep:
            self._sample_and_emit([reqs[i] for i in keep], logits[keep])

    def _decode(self, reqs: list[Request]) -> None:
        seqs = [r.seq for r in reqs]
        out = self.runner.forward(seqs, [[s.last_token_id] for s in seqs], prefill=False)
        for s in seqs:
            s.num_cached += 1
        self._sample_and_emit(reqs, out.logits[:, 0])

    def _sample_and_emit(self, reqs: list[Request], logits: Tensor) -> None:
        params = [r.seq.params for r in reqs]
        adjusted = logits
        if any(p.penalized for p in params):
            adjusted = torch.cat(
                [
                    adjusted_logits(logits[i : i + 1], r.seq, self.eos_token_ids).float()
                    for i, r in enumerate(reqs)
                ]
            )
        # logprobs come from _emit (raw logits, per request that asks): none needed from the sampler
        chosen = sample(adjusted, params, [r.seq.generator for r in reqs], logprobs=False).token_ids.tolist()
        for row, r in enumerate(reqs):
            self._emit(r, [chosen[row]], logits[row : row + 1])

    def _speculate(self, reqs: list[Request]) -> None:
        drafts = self._propose(reqs)
        seqs = [r.seq for r in reqs]
        out = self.runner.forward(
            seqs, [[s.last_token_id, *d] for s, d in zip(seqs, drafts, strict=True)], prefill=False
        )
        for row, (r, d) in enumerate(zip(reqs, drafts, strict=True)):
            s, k = r.seq, len(d)
            rows = out.logits[row, : k + 1]  # (k+1, V): the target at the last token and each draft
            adjusted = adjusted_logits(rows, s, self.eos_token_ids, d)
            # greedy rows: processed_logits would only divide by temperature 1 (exact), so skip it
            target = adjusted if s.params.greedy else processed_logits(adjusted, [s.params] * (k + 1))
            emitted = rejection_sample(
                torch.tensor(d, dtype=torch.int64),
                target,
                None,
                greedy=s.params.greedy,
                generator=s.generator,
            )
            n = len(emitted) - 1
            if k:
                r.spec_steps.append((k, n))
                r.stats = r.stats.observe(k, n)
                self.spec_decoding_stats = self.spec_decoding_stats.observe(k, n)
            s.num_cached += n + 1  # the last token and the n accepted drafts are cached
            self.scheduler.rollback(s, s.num_cached)  # free the rejected drafts' slots
            r.pending_hidden = out.hidden[row, : n + 1]
            self._emit(r, emitted.tolist(), rows[: n + 1])

    def _propose(self, reqs: list[Request]) -> list[list[int]]:
        """k greedy MTP drafts per request; fewer near max_model_len and near max_tokens, as vLLM's
        scheduler caps a step at prompt + max_tokens - 1 computed tokens: a step then emits at most the
        tokens the request may still emit, so accepted drafts never exceed emitted tokens."""
        drafts: list[list[int]] = [[] for _ in reqs]
        ks = [min(self.k, self.config.max_model_len - r.seq.num_tokens, _room(r.seq) - 1) for r in reqs]
        active = [i for i, k in enumerate(ks) if k > 0 and reqs[i].pending_hidden is not None]
        if not active:
            return drafts
        seqs = [reqs[i].seq for i in active]
        hidden = [reqs[i].pending_hidden for i in active]
        starts = [s.num_cached - h.shape[0] for s, h in zip(seqs, hidden, strict=True)]
        tokens = [s.all_token_ids[st + 1 : s.num_cached + 1] for s, st in zip(seqs, starts, strict=True)]
        out = self.runner.mtp(seqs, tokens, hidden, starts, last_only=True)
        last = torch.tensor([len(t) - 1 for t in tokens])
        rows = torch.arange(len(active))
        logits, h = out.logits[:, -1], out.hidden[rows, last]  # (A, V), (A, H): each row's last token
        for i in active:
            reqs[i].pending_hidden = None  # the MTP cache has seen them now
        for j in range(self.k):
            for a, token in enumerate(logits.argmax(dim=-1).tolist()):
                drafts[active[a]].append(token)  # MTP drafts greedily, as vLLM's proposer
            # Chain: the MTP layer at position N-1+j reads its own hidden state and draft j+1.
            chain = [a for a, i in enumerate(active) if ks[i] > j + 1]
            if not chain:
                break
            out = self.runner.mtp(
                [seqs[a] for a in chain],
                [[drafts[active[a]][-1]] for a in chain],
                [h[a : a + 1] for a in chain],
                [seqs[a].num_cached + j for a in chain],
            )
            active = [active[a] for a in chain]
            seqs = [seqs[a] for a in chain]
            logits, h = out.logits[:, 0], out.hidden[:, 0]
        return drafts

    def _emit(self, r: Request, tokens: list[int], rows: Tensor) -> None:
        """Append tokens (each predicted by the matching row of raw logits) until a stop condition."""
        s, p = r.seq, r.seq.params
        entries = _logprob_entries(rows, tokens, p.logprobs) if p.logprobs is not None else None  # raw
        for i, token in enumerate(tokens):
            lp = 0.0
            if entries is not None:
                lp = entries[i][token]
                r.new_logprobs.append(entries[i])
                r.cumulative_logprob += lp
            s.append(token, lp)
            r.new_token_ids.append(token)
            finished = check_stop_token(s, self.eos_token_ids, self.config.max_model_len)
            if r.detok is not None:
                by_token = finished and s.finish_reason is FinishReason.STOP
                early = len(s.output_token_ids) <= p.min_tokens  # vLLM: no stop strings before min_tokens
                if r.detok.add_token(token, skip_text=by_token, check_stop=not early):
                    s.finish(FinishReason.STOP, r.detok.stop_reason)
            if s.is_finished:
                return

    def _delta(self, r: Request) -> RequestOutput:
        s = r.seq
        finished = s.is_finished
        want_lp = s.params.logprobs is not None
        completion = CompletionOutput(
            index=0,
            text=r.detok.next_delta(finished) if r.detok else "",
            token_ids=tuple(r.new_token_ids),
            cumulative_logprob=r.cumulative_logprob if want_lp else None,
            logprobs=tuple(r.new_logprobs) if want_lp else None,
            finish_reason=s.finish_reason.value if finished and s.finish_reason else None,
            stop_reason=s.stop_reason,
        )
        r.new_token_ids, r.new_logprobs = [], []
        prompt_lp, r.prompt_logprobs = r.prompt_logprobs, None
        return RequestOutput(
            str(s.seq_id),
            r.prompt,
            tuple(s.prompt_token_ids),
            (completion,),
            finished,
            r.stats,
            prompt_logprobs=tuple(prompt_lp) if prompt_lp is not None else None,
            spec_steps=tuple(r.spec_steps) if finished and self.k else None,
        )


def _logprob_entries(rows: Tensor, tokens: Sequence[int], top_n: int | None) -> list[dict[int, float]]:
    """Per row of raw logits (n, V): {token: logprob} of ``tokens[i]`` plus the top ``top_n`` (-1: all).

    vLLM's raw logprobs: log_softmax of the raw logits, before penalties, temperature and truncation."""
    logprobs = torch.log_softmax(rows.float(), dim=-1)  # (n, V)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), dtype=torch.int64)[:, None])[:, 0].tolist()
    n = logprobs.shape[-1] if top_n == -1 else (top_n or 0)
    entries = [{int(t): lp} for t, lp in zip(tokens, chosen, strict=True)]
    if n:
        top = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
        for entry, ids, values in zip(entries, top.indices.tolist(), top.values.tolist(), strict=True):
            for t, v in zip(ids, values, strict=True):
                entry.setdefault(t, v)
    return entries


def _room(seq: Seq) -> int:
    """Output tokens ``seq`` may still emit under max_tokens (a large number without a limit)."""
    limit = seq.params.max_tokens
    return 1 << 30 if limit is None else limit - len(seq.output_token_ids)


def _too_long(n: int, config: EngineConfig) -> str:
    """What can make a prompt of ``n`` tokens fit: a larger max_model_len only up to the model's context."""
    m, limit = config.max_model_len, config.max_position_embeddings
    head = f"prompt of {n} tokens does not fit max_model_len={m}"
    if limit is None:
        return f"{head}; shorten it or raise max_model_len"
    if n <= limit:
        return f"{head}; raise --max-model-len to at least {n} (the model takes up to {limit}) or shorten it"
    return f"{head}; the model's context is {limit} tokens (max_position_embeddings): shorten the prompt"
