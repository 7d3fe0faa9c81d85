"""Statistics shared by the sampling tests."""

from __future__ import annotations

import torch


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed counts against expected probabilities (cells with p > 0)."""
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability token was emitted"
    return float(((counts[keep].double() - expected[keep]) ** 2 / expected[keep]).sum())
