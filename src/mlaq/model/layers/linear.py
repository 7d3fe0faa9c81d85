"""Linear layers that stay fast in bf16 on CPUs without a native bf16 GEMM.

On x86 CPUs without AVX-512 (e.g. an AMD EPYC that exposes AVX2 only), torch's bf16 matmul falls
back to a generic kernel that is 3-9x slower than MKL's float32 GEMM on the same shapes (measured:
2048 x 512 @ 512 x 1024, 1 thread, 9.6 vs 86 GFLOP/s). A bf16 GEMM multiplies bf16 values exactly in
float32, accumulates in float32 and rounds the result to bf16 once; ``linear`` does the same through
the float32 GEMM (operands upcast exactly, result rounded to the input's dtype), so only the
accumulation order differs, as between any two GEMM kernels (about 1 element in 5,000 differs by one
bf16 ulp). Single-row inputs keep the bf16 kernel: at one row, upcasting the weight costs more than it
saves. Where the CPU has a native bf16 GEMM (oneDNN: AVX-512 or AMX) nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LOW_PRECISION = (torch.bfloat16, torch.float16)
MIN_ROWS = 2  # one row: the bf16 GEMV beats upcasting the weight (0.7-0.9x); 2 rows 1.0-1.2x, 4 rows 1.6-2x


def _probe_native_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # an older or unusual build: assume the fast path
        return True


# A fact of the machine, read once at import (microseconds). A constant rather than a cached call:
# under torch.compile dynamo folds a module constant, while it traces through a cache into
# torch.backends, which it may not trace; that graph break at every multi-row linear made compiled
# batched decode slower than eager.
_NATIVE_BF16 = _probe_native_bf16()


def native_low_precision_gemm() -> bool:
    """Whether torch's CPU matmul runs bf16 through oneDNN (fast) rather than its generic fallback."""
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
