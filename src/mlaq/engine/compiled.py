"""``compile=True``: decode, verification and MTP steps through ``torch.compile`` (inductor, CPU C++).

Eager decode is bound by per-op dispatch (~330 tensor ops per token at a few microseconds each on
these model sizes); inductor fuses them into a few C++ kernels. Prompts (prefill) stay eager: they
run once per request and their lengths vary. The compiled step is
:class:`mlaq.model.static_step.StaticStep`, free of data-dependent Python control flow; the cache
length S is marked dynamic, so a growing cache does not recompile (batch size and T, the tokens per
row, are specialized: a handful of shapes per run). Inductor freezes the parameters (weights become
constants of the graph, linear weights prepacked for MKL) and emits a C++ launcher; both settings
apply only while these steps run (torch's global config is left as it was). Frozen graphs belong to
one model: dynamo guards the parameters by identity, so another ``LLM`` in the same process compiles
its own (tested), and the process's compile cache keeps the weights of earlier ones alive.

Compilation happens on first use of each shape (seconds to a minute on a few cores); tokens chosen
greedily are those of the eager path on the tested checkpoints, but logits may differ in the last
bits (fused reductions round differently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mlaq.engine.adapter import DeepseekLatentLM
from mlaq.engine.model_api import LMOutput
from mlaq.model import DeepseekForCausalLM
from mlaq.model.static_step import StaticStep

# Recompiles one run may need: batch sizes x T values (1, k+1, MTP catch-up lengths) x logits_index.
CACHE_SIZE_LIMIT = 64


class CompiledLatentLM(DeepseekLatentLM):
    """``DeepseekLatentLM`` whose absorbed-path calls run compiled (prefill stays eager)."""

    accepts_room = False  # the compiled step takes the gathered (layers, B, S, L+R) as it is

    def __init__(self, model: DeepseekForCausalLM, *, backend: str = "inductor") -> None:
        """``backend``: torch.compile's (tests use "aot_eager": the same graphs, no C++ build)."""
        super().__init__(model)
        self.static = StaticStep(model)
        self._decode = _compiled(self.static.decode, backend)
        self._mtp = _compiled(self.static.mtp, backend)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        past: Sequence[Tensor],
        *,
        prefill: bool,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        if prefill or len(past) == 0 or past[0].shape[1] == 0:
            return super().forward(input_ids, positions, past, prefill=prefill, logits_index=logits_index)
        cos, sin = self._rotation(positions, past[0].shape[1])
        # (layers, B, S, L+R) as one tensor (the engine gathers it so); S, the cache length, is dynamic
        stacked = past if isinstance(past, Tensor) else torch.stack(tuple(past))
        torch._dynamo.mark_dynamic(stacked, 2)
        logits, hidden, entries = self._decode(input_ids, positions, stacked, cos, sin, logits_index)
        return LMOutput(logits, hidden, entries)  # entries: (layers, B, T, L+R)

    @torch.no_grad()
    def mtp(
        self,
        input_ids: Tensor,
        hidden: Tensor,
        positions: Tensor,
        past: Tensor,
        *,
        step: int,
        logits_index: Tensor | None = None,
    ) -> LMOutput:
        if past.shape[1] == 0:  # nothing cached yet: the eager path (once per request)
            return super().mtp(input_ids, hidden, positions, past, step=step, logits_index=logits_index)
        cos, sin = self._rotation(positions, past.shape[1])
        torch._dynamo.mark_dynamic(past, 1)
        logits, y, entry = self._mtp(input_ids, hidden, positions, past, cos, sin, logits_index)
        return LMOutput(logits, y, (entry,))

    def _rotation(self, positions: Tensor, num_past: int) -> tuple[Tensor, Tensor]:
        """RoPE cos / sin (B, T, R) of ``positions``; checks they continue a past of ``num_past``."""
        t = positions.shape[1]
        # one token a row is consecutive by itself (decode: skip two tensor ops a step)
        consecutive = t == 1 or torch.equal(positions, positions[:, :1] + torch.arange(t))  # (B, T)
        if not consecutive or int(positions[:, 0].max()) != num_past:
            raise ValueError(
                f"positions must be consecutive per row and the longest row must start at the "
                f"gathered cache length {num_past}"
            )
        return self.model.rope_table.rotation(positions, num_past + t - 1)


class _Settings:
    """torch config values set only while a compiled step runs (and may trace / compile), then restored.

    ``freezing``: inductor treats the model's parameters as constants (linear weights prepacked for
    MKL, casts of weights folded); it is read while dynamo traces, so ``torch.compile(options=...)``
    alone would not apply it. ``cpp_wrapper``: the graph's launcher in C++ instead of Python (fewer
    microseconds per step). ``emulate_precision_casts``: fused kernels round bf16 / fp16 intermediates
    where eager does (no effect in fp32; ~10 % slower bf16 steps, but eager's greedy tokens at batch 1
    on the bundled model, which fp32-held intermediates change). Plain attribute swaps:
    ``config.patch`` costs ~20 us a call."""

    def __init__(self, backend: str) -> None:
        inductor = backend == "inductor"
        self.items = [(torch._dynamo.config, "recompile_limit", CACHE_SIZE_LIMIT)]
        if inductor:
            self.items += [(torch._inductor.config, "freezing", True)]
            self.items += [(torch._inductor.config, "cpp_wrapper", True)]
            self.items += [(torch._inductor.config, "emulate_precision_casts", True)]
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = [getattr(module, name) for module, name, _ in self.items]
        for module, name, value in self.items:
            setattr(module, name, value)

    def __exit__(self, *exc: object) -> None:
        for (module, name, _), value in zip(self.items, self.saved, strict=True):
            setattr(module, name, value)


def _compiled(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``fn`` compiled, with room for the shapes one run produces; parameters frozen (inductor)."""
    compiled = torch.compile(fn, backend=backend, dynamic=None)
    settings = _Settings(backend)

    def call(*args: Any) -> Any:
        with settings:
            return compiled(*args)

    return call
