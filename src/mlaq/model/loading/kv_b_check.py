"""``mlaq explain --check-weights``: read every kv_b_proj weight (nothing else) and report NaN/inf.

``mlaq explain`` reads only config files by default, so a checkpoint whose kv_b_proj holds NaN/inf
explains cleanly; this check (opt-in: it reads kv_lora_rank x heads x (P + V) values a layer) says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlaq.model.config import ModelConfig
from mlaq.model.loading.checkpoint import SafetensorsCheckpoint
from mlaq.model.loading.weights import CheckpointQuant, read_linear
from mlaq.policy import PolicyResult


def not_checked_note() -> str:
    return (
        "weights:     not read (explain reads config files only); --check-weights reads kv_b_proj for NaN/inf"
    )


@dataclass(frozen=True)
class WeightCheck:
    layers: int  # how many kv_b_proj weights were read
    bad: tuple[tuple[str, int, int], ...]  # (module, NaN count, inf count) per bad weight

    @property
    def ok(self) -> bool:
        return not self.bad

    def text(self) -> str:
        if self.ok:
            return f"weights:     kv_b_proj of all {self.layers} MLA layers read: every value finite"
        shown = "; ".join(f"{m}: {n} NaN, {i} inf" for m, n, i in self.bad[:3])
        more = f"; ... ({len(self.bad)} weights in all)" if len(self.bad) > 3 else ""
        return (
            f"weights:     {len(self.bad)} of {self.layers} kv_b_proj weights hold NaN/inf after dequantization: "
            f"{shown}{more}; the checkpoint is corrupt there"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "layers_read": self.layers,
            "non_finite": [{"module": m, "nan": n, "inf": i} for m, n, i in self.bad],
        }


def check_kv_b_weights(path: str | Path, result: PolicyResult) -> WeightCheck:
    """Read each decided layer's kv_b_proj as stored, dequantize it exactly, count NaN and inf."""
    cfg = ModelConfig.from_dir(path)
    quant = CheckpointQuant.from_hf(cfg.hf, str(Path(path) / "config.json"))
    shape = (cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    bad: list[tuple[str, int, int]] = []
    with SafetensorsCheckpoint(path) as ckpt:
        present = [d.module for d in result.layers if ckpt.has(f"{d.module}.weight")]
        for module in present:
            w = read_linear(ckpt, quant, module, shape).dequantize()
            nan, inf = int(torch.isnan(w).sum()), int(torch.isinf(w).sum())
            if nan or inf:
                bad.append((module, nan, inf))
    if not present:
        raise ValueError(
            f"{path}: no kv_b_proj weight found for --check-weights (names like {result.layers[0].module}.weight)"
        )
    return WeightCheck(len(present), tuple(bad))
