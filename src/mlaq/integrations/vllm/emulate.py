"""Emulation mode: one MLA layer's two absorbed BMMs run an mlaq scheme, bit for bit, on any device.

vLLM 0.32's ``MLAAttention`` multiplies by two weights it prepared in ``process_weights_after_loading``
(vllm/model_executor/layers/attention/mla_attention.py):

    forward_impl   torch.bmm(q_nope (N, B, P), self.W_UK_T (N, P, L), out=...)   # q absorption
    _v_up_proj     torch.bmm(x (N, B, L), self.W_UV (N, L, V), out=...)          # V up-projection

which are exactly mlaq's (N, B, K) x (N, K, M) operands: W_UK and W_UV^T. The plugin replaces the two
weights by :class:`EmulatedBmmWeight` objects; their ``__torch_function__`` answers that one call with
``scheme.apply`` (pure torch, on the activations' device) and writes the result into vLLM's ``out``. The
rest of the layer is vLLM's own. Under ``precision: consistent`` kv_b_proj's weight (prefill's
decompression) becomes the scheme's dequantized weights rounded to its dtype, as mlaq's engine does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from mlaq.bmm import BmmScheme, PreparedWeight
from mlaq.model.layers.mla_core import join_kv_b


@dataclass(frozen=True, eq=False)
class EmulatedBmmWeight:
    """Stands where vLLM keeps W_UK_T or W_UV; ``torch.bmm(x, this, out=o)`` runs ``scheme.apply``."""

    scheme: BmmScheme
    prepared: PreparedWeight
    name: str  # "model.layers.3.self_attn.attn W_UK_T", for messages

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.prepared.shape)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.bmm or len(args) != 2 or not isinstance(args[1], cls):
            raise TypeError(
                f"mlaq's emulated BMM weight supports only torch.bmm(x, weight[, out=]) (vLLM 0.32's two "
                f"absorbed BMMs); vLLM called {getattr(func, '__name__', func)}: this vLLM path is not emulated"
            )
        x, w = args
        y = w.scheme.apply(x, w.prepared)  # float32 (N, B, M), values already rounded to out_dtype
        out = kwargs.get("out")
        if out is None:
            return y.to(x.dtype)
        return out.copy_(y)


def emulated(scheme: BmmScheme, weight: Tensor, name: str) -> EmulatedBmmWeight:
    """Quantize one (N, K, M) weight once, on its own device."""
    return EmulatedBmmWeight(scheme, scheme.prepare(weight.detach()), name)


def consistent_kv_b(w_uk: EmulatedBmmWeight, w_uv: EmulatedBmmWeight, dtype: torch.dtype) -> Tensor:
    """kv_b_proj's (N*(P+V), L) weight as the scheme sees it, rounded to ``dtype``: what mlaq's
    engine decompresses with under ``Precision.CONSISTENT``."""
    return join_kv_b(w_uk.prepared.dequantize(), w_uv.prepared.dequantize()).to(dtype)
