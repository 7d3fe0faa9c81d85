"""RMSNorm as the DeepSeek-V3 family computes it (transformers' DeepseekV3RMSNorm / T5LayerNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """``weight * (x / sqrt(mean(x^2) + eps))``; statistics in float32, normalized x rounded to the
    input dtype BEFORE the weight multiply (so bf16 models round where the reference rounds)."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, *, dtype: torch.dtype = torch.float32, device=None
    ) -> None:
        super().__init__()
        if hidden_size <= 0:
            raise ValueError(f"RMSNorm size must be positive, got {hidden_size}")
        if not eps > 0:
            raise ValueError(f"RMSNorm eps must be > 0, got {eps}")
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call instead of six: torch's rms_norm does the same float32 operations in the same
            # order (tests/test_model_norm.py pins the bits against the formula below).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
