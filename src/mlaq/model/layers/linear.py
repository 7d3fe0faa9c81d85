"""Linear layers that stay fast in bf16 on CPUs without a native bf16 GEMM.

On x86 CPUs without AVX-512 (e.g. an AMD EPYC that exposes AVX2 only), torch's bf16 matmul falls
back to a generic kernel that is 3-9x slower than MKL's float32 GEMM on the same shapes (measured:
2048 x 512 @ 512 x 1024, 1 thread, 9.6 vs 86 GFLOP/s). A bf16 GEMM multiplies bf16 values exactly in
float32, accumulates in float32 and rounds the result to bf16 once; ``linear`` does the same through
the float32 GEMM (operands upcast exactly, result rounded to the input's dtype), so only the
accumulation order differs, as between any two GEMM kernels (about 1 element in 5,000 differs by one
bf16 ulp). Single-row inputs keep the bf16 kernel: at one row, upcasting the weight costs more than it
saves.

Which path a machine takes is decided once, from the CPU's identity (never from a timing, so a machine's
numerics do not depend on its load). oneDNN's bf16 GEMM is the fast one with AMX (Intel Sapphire Rapids
and later) and on AMD CPUs with AVX512_BF16 (Zen 4: 1.4x float32). On an Intel CPU with AVX512_BF16 but
no AMX (Cooper Lake; a Sapphire or Emerald Rapids whose hypervisor hides AMX) oneDNN still takes bf16,
and there it is the slow one: 4096 x 256 @ 256 x 768 in 13.4 ms against 8.2 ms through the float32 GEMM,
torch 2.13, 2 threads, Intel Xeon (Emerald Rapids, AMX hidden), 2026-12-06. Those CPUs take the float32
path too, from ``MIN_ROWS`` rows as the others: with the prefill's attention in float32 as well
(``mla_core.float32_flash``), ``mlaq validate``'s default run took 0.80x the CPU time (bench/RESULTS.md), and
mlaq.LLM generating 64 tokens after 32 prompts of 256 tokens 3.82 s against 4.06 s (medians of 4, alternated
in one process). One path from 2 rows on also keeps a layer's arithmetic independent of how a caller splits
its rows into calls of 2 or more (the layer-streamed validation's chunks).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
MIN_ROWS = 2  # one row: the bf16 GEMV beats upcasting the weight (0.7-0.9x); 2 rows 1.0-1.2x, 4 rows 1.6-2x


def onednn_bf16_gemm() -> bool:
    """Whether this torch runs bf16 GEMMs through oneDNN (AVX512_BF16 or AMX; else its generic kernel)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or unusual build: assume the fast path
        return True


def cpu_identity(lines: Iterable[str]) -> tuple[str, frozenset[str]]:
    """(vendor_id, feature flags) of the first processor in /proc/cpuinfo's lines ("" and none if absent).
    Reads no further than that processor's block: the kernel writes the file as it is read, a block per
    CPU, so on a many-core machine the rest is work nobody needs at import."""
    fields: dict[str, str] = {}
    for row in lines:
        if not row.strip():
            break  # the first processor's block ends here
        name, _, value = row.partition(":")
        fields[name.strip()] = value.strip()
    return fields.get("vendor_id", ""), frozenset(fields.get("flags", "").split())


def fast_bf16_gemm(onednn_bf16: bool, vendor: str, flags: frozenset[str]) -> bool:
    """Whether torch's bf16 GEMM beats upcasting to float32 (module docstring): oneDNN takes bf16, and the
    CPU is not an Intel one without AMX. Without a /proc/cpuinfo (vendor ""), oneDNN's word stands."""
    return onednn_bf16 and not (vendor == "GenuineIntel" and "amx_bf16" not in flags)


def _probe_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            vendor, flags = cpu_identity(f)
    except OSError:  # not Linux
        vendor, flags = "", frozenset()
    return fast_bf16_gemm(onednn_bf16_gemm(), vendor, flags)


# A fact of the machine, read once at import (microseconds). A constant rather than a cached call:
# under torch.compile dynamo folds a module constant, while it traces through a cache into
# torch.backends, which it may not trace; that graph break at every multi-row linear made compiled
# batched decode slower than eager.
_NATIVE_BF16 = _probe_native_bf16()


def native_low_precision_gemm() -> bool:
    """Whether bf16 GEMMs run in bf16 (oneDNN, and faster than float32 on this CPU) rather than upcast."""
    return _NATIVE_BF16


def upcast_gemm(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs through the float32 GEMM."""
    return (
        weight.dtype in LOW_PRECISION
        and weight.device.type == "cpu"
        and x.numel() >= MIN_ROWS * x.shape[-1]
        and not native_low_precision_gemm()
    )


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` in x's dtype; float32 arithmetic where that is the fast path."""
    if not upcast_gemm(x, weight):
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


class Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``linear`` (same parameters and state_dict names)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` that leaves a table on the meta device uninitialised: the loader builds the
    model on meta and fills every tensor from the checkpoint, and torch's ``normal_`` on meta would
    import torch._dynamo (~1-2 s at start-up) to draw values nobody reads. Elsewhere as nn.Embedding."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


def fuse_rows(*layers: nn.Linear) -> Tensor | None:
    """The weights of linears that read one input, stacked by rows (vLLM's ``fused_qkv_a_proj``,
    ``gate_up_proj``): one GEMM instead of several, its output split by columns (also the routed
    experts' stacked gate and up weights, ``MoE.stack_experts``). Each layer's weight
    becomes a view of the stacked tensor (no second copy; state_dict and in-place loads see the same
    memory). None, and nothing changed, where a layer has a bias or their dtypes, devices or input
    widths differ. oneDNN's bf16 and float32 GEMMs give each output column the same bits stacked or
    apart (``tests/test_linear.py``)."""
    weights = [layer.weight for layer in layers]
    if any(layer.bias is not None for layer in layers):
        return None
    if len({(w.dtype, w.device, w.dim(), w.shape[-1]) for w in weights}) != 1 or weights[0].dim() != 2:
        return None
    fused = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        rows = w.shape[0]
        w.data = fused[start : start + rows]
        start += rows
    return fused
