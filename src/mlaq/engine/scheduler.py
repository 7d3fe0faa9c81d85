"""Continuous batching: which sequences run this step, and with how many cache slots.

Each step is either a prefill of newly admitted sequences or one decode step of every running
sequence (the nano-vllm / vLLM v0 policy, simple and deterministic). A sequence joins the running
set as soon as a slot (``max_num_seqs``) and cache blocks are free, and leaves it when it
finishes, so short requests do not wait for long ones. When the pool runs dry during decode the
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later from
its prompt plus the tokens it had produced (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mlaq.engine.block_manager import BlockManager
from mlaq.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits (vLLM's names)."""

    max_num_seqs: int = 16
    max_model_len: int = 2048
    max_num_batched_tokens: int | None = None  # prefill tokens per step; None = max_model_len
    num_lookahead_slots: int = 0  # extra slots per decode step: k draft tokens when speculating

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_model_len < 1:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) and max_model_len ({self.max_model_len}) must be >= 1"
            )
        if self.num_lookahead_slots < 0:
            raise ValueError(f"num_lookahead_slots must be >= 0, got {self.num_lookahead_slots}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len}) so that every admissible prompt can be prefilled"
            )

    @property
    def prefill_token_budget(self) -> int:
        return self.max_num_batched_tokens or self.max_model_len


@dataclass(frozen=True)
class ScheduledBatch:
    """The sequences of one step; prefill sequences need all their uncached tokens computed."""

    seqs: tuple[Sequence, ...]
    is_prefill: bool


class Scheduler:
    """Waiting queue + running set over a ``BlockManager``."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if block_manager.max_model_len < config.max_model_len:
            raise ValueError("the block manager's max_model_len is smaller than the scheduler's")
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a new request; a prompt that can never fit is rejected here, with the reason."""
        self.blocks.check_fits(len(seq.prompt_token_ids))
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's batch: admit and prefill waiting sequences if any fit, else decode."""
        prefill: list[Sequence] = []
        budget = self.config.prefill_token_budget
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > budget and prefill:
                break
            if not self.blocks.can_grow(seq.seq_id, seq.num_tokens):
                break
            self.blocks.grow(seq.seq_id, seq.num_tokens)
            budget -= seq.num_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(self.waiting.popleft())
            prefill.append(seq)
        if prefill:
            return ScheduledBatch(tuple(prefill), is_prefill=True)
        if not self.running and self.waiting:
            raise ValueError("the KV cache pool cannot hold the next waiting prompt even when empty")

        decode: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below while making room for an earlier sequence
            need = min(seq.num_tokens + self.config.num_lookahead_slots, self.config.max_model_len)
            while not self.blocks.can_grow(seq.seq_id, need):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.blocks.grow(seq.seq_id, need)
                decode.append(seq)
        return ScheduledBatch(tuple(decode), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_cached = 0  # recompute: prompt + outputs are prefilled again
        self.waiting.appendleft(seq)

    def rollback(self, seq: Sequence, num_cached: int) -> None:
        """After verification: keep ``num_cached`` slots (the accepted prefix), free the rest."""
        self.blocks.truncate(seq.seq_id, num_cached)
        seq.num_cached = num_cached

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is (waiting or running) and free its blocks now."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.free(seq.seq_id)

    def finish_done(self) -> list[Sequence]:
        """Free the blocks of sequences that finished this step and drop them from the running set."""
        done = [s for s in self.running if s.is_finished]
        for seq in done:
            self.blocks.free(seq.seq_id)
            self.running.remove(seq)
        return done
