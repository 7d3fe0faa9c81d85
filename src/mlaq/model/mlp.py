"""The dense SwiGLU MLP of DeepSeek-V3-family decoder layers (and of each expert)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DenseMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)); Hugging Face parameter names."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
