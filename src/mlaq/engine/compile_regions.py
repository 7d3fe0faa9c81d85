"""torch.compile plumbing of ``compile=True`` (mlaq.engine.compiled): each piece a compile region of its
own, guarded on its inputs only, and the torch settings in force while a step's pieces run."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Graphs one piece may need in a run: batch sizes x T values (1, k+1), static then dynamic.
CACHE_SIZE_LIMIT = 64


class Settings:
    """torch config values set only while a compiled step runs (and may trace / compile), then restored;
    entered once a step around all its pieces (the eager attention between them reads none of them).

    ``freezing``: inductor treats the model's parameters as constants (linear weights prepacked for
    MKL, casts of weights folded); it is read while dynamo traces, so ``torch.compile(options=...)``
    alone would not apply it. ``cpp_wrapper``: the graph's launcher in C++ instead of Python (fewer
    microseconds per step). ``emulate_precision_casts``: fused kernels round bf16 / fp16 intermediates
    where eager does (no effect in fp32; ~10 % slower bf16 steps, but eager's greedy tokens at batch 1
    on the bundled model, which fp32-held intermediates change). ``max_autotune`` (opt-in): each GEMM
    timed as inductor's C++ template and as oneDNN's call, the faster kept. Plain attribute swaps:
    ``config.patch`` costs ~20 us a call."""

    def __init__(self, backend: str, *, max_autotune: bool = False) -> None:
        inductor = backend == "inductor"
        self.items = [(torch._dynamo.config, "recompile_limit", CACHE_SIZE_LIMIT)]
        if inductor:
            self.items += [(torch._inductor.config, "freezing", True)]
            self.items += [(torch._inductor.config, "cpp_wrapper", True)]
            self.items += [(torch._inductor.config, "emulate_precision_casts", True)]
        if inductor and max_autotune:
            self.items += [(torch._inductor.config, "max_autotune", True)]
            self.items += [(torch._inductor.config, "max_autotune_gemm_backends", "CPP,ATEN")]
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = [getattr(module, name) for module, name, _ in self.items]
        for module, name, value in self.items:
            setattr(module, name, value)

    def __exit__(self, *exc: object) -> None:
        for (module, name, _), value in zip(self.items, self.saved, strict=True):
            setattr(module, name, value)


# The roots of the guards on a piece's own state: the StepPieces of ``head`` / ``mtp_*`` (a bound method:
# ``self``), the bound method and layer index that ``compiled._at`` closes over (``piece``, ``i``). Everything the
# model holds hangs below them. And ``G``, the globals the pieces' code reads (mlaq's module functions such
# as ``mla.rotate``, builtins such as ``len``: ~50 identity checks a call). A guard's name is a source
# expression: "piece.__self__.experts", "type(self.model)", "G['__import_mlaq_dot_model_dot_mla'].rotate",
# ...; its root is the first name after any call wrappers.
_OWN_STATE = frozenset({"self", "piece", "i", "G"})
_ROOT = re.compile(r"^(?:\w+\()*(\w+)")


def inputs_only(entries: Sequence[Any]) -> list[bool]:
    """A ``guard_filter_fn``: keep dynamo's guards on the arguments (dtype, shape, strides of each
    input) and on torch's global state; drop those on the piece's own state (hundreds of type, key and
    tensor checks down the model's modules) and on the module globals its code reads (batch-1 decode
    +7-15 % on an AMD EPYC Zen 4). Safe because each piece has its own compile region
    (``isolate_recompiles``: no other model's graphs to tell apart), ``CompiledLatentLM`` refuses to run
    a model re-prepared after it was built, and mlaq never rebinds its module functions (a function
    monkeypatched after the pieces compiled is not seen by them, as the model's own state is not)."""
    return [_root(e.name) not in _OWN_STATE for e in entries]


def _root(name: str) -> str:
    match = _ROOT.match(name)
    return match.group(1) if match else ""


def compiled_region(
    fn: Callable[..., Any], backend: str, *, guards: Callable[..., list[bool]] = inputs_only
) -> Callable[..., Any]:
    """``fn`` compiled in a region of its own, guarded on its inputs, with room for the shapes one run
    produces; parameters frozen (inductor) when called under ``Settings`` (as ``CompiledLatentLM``
    calls its pieces: once a step, not once a piece: each swap costs microseconds)."""
    options = {"guard_filter_fn": guards}
    return torch.compile(fn, backend=backend, dynamic=None, options=options, isolate_recompiles=True)
