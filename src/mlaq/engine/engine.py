"""The engine step: schedule, run the model, sample (or draft with MTP and verify), emit deltas.

Speculative decoding with MTP, per running sequence of N tokens (main cache holds positions
0..N-2; the last token is not yet processed):
1. catch up the MTP layer's cache with the target hidden states of the positions the last
   verification accepted (MTP at position p reads h_p and token p+1) and take its argmax as
   draft 1; chain the MTP layer on its own hidden state for drafts 2..k (vLLM's MTP proposer);
2. verify [last token, d_1..d_k] in ONE target pass (absorbed MLA, query length k+1);
3. ``rejection_sample`` keeps the accepted prefix plus one target token; the cache is rolled
   back to the accepted positions; the metrics observe (k, accepted).
Under greedy sampling the emitted tokens are exactly plain greedy decoding's. The drafts come from
``mlaq.engine.speculate``; a request's state and its per-step deltas live in ``mlaq.engine.request``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.config import EngineConfig, too_long_message
from mlaq.engine.detokenizer import IncrementalDetokenizer
from mlaq.engine.kv_cache import LatentCacheConfig, LatentKVCache
from mlaq.engine.model_api import LatentLM
from mlaq.engine.outputs import RequestOutput
from mlaq.engine.penalties import adjusted_logits
from mlaq.engine.rejection import rejection_sample
from mlaq.engine.request import Request, logprob_entries
from mlaq.engine.runner import ModelRunner
from mlaq.engine.sampler import processed_logits, sample
from mlaq.engine.sampling_params import SamplingParams
from mlaq.engine.scheduler import Scheduler, SchedulerConfig
from mlaq.engine.sequence import FinishReason
from mlaq.engine.sequence import Sequence as Seq
from mlaq.engine.spec_metrics import SpecDecodingStats
from mlaq.engine.speculate import propose
from mlaq.engine.tokenizer import Tokenizer

__all__ = ["EngineConfig", "LLMEngine"]


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
            raise ValueError(too_long_message(len(seq.prompt_token_ids), self.config))
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
        outputs = [r.delta(bool(self.k)) for r in reqs]
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
                    *logprob_entries(
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
        # logprobs come from Request.emit (raw logits, per request that asks): none needed from the sampler
        chosen = sample(adjusted, params, [r.seq.generator for r in reqs], logprobs=False).token_ids.tolist()
        for row, r in enumerate(reqs):
            r.emit([chosen[row]], logits[row : row + 1], self.eos_token_ids, self.config.max_model_len)

    def _speculate(self, reqs: list[Request]) -> None:
        drafts = propose(self.runner, reqs, self.k, self.config.max_model_len)
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
            r.emit(emitted.tolist(), rows[: n + 1], self.eos_token_ids, self.config.max_model_len)
