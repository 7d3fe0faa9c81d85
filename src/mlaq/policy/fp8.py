"""``quant_method: fp8`` — DeepSeek/GLM block FP8 (and plain per-tensor FP8) checkpoints.

DeepSeek-V3 writes ``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}``; GLM adds ``modules_to_not_convert`` (exact names of the weights
kept in bf16); vLLM's own FP8 export uses ``ignored_layers``; DeepSeek-V3.1 adds ``scale_fmt: ue8m0``
(power-of-two block scales). Without ``weight_block_size`` the weights carry one scale per tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.policy import stored as st
from mlaq.policy.checkpoint import CheckpointQuant, KvBStorage, block_size
from mlaq.policy.patterns import Pattern, parse_patterns


@dataclass(frozen=True)
class Fp8Quant(CheckpointQuant):
    weight: st.StoredFormat
    not_converted: tuple[Pattern, ...]
    activation_scheme: str | None
    method: str = "fp8"

    @classmethod
    def parse(cls, qc: Mapping[str, Any]) -> Fp8Quant:
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"quantization_config.fmt {fmt!r}: mlaq reads only e4m3 FP8 checkpoints")
        scale_fmt = qc.get("scale_fmt")
        if "weight_block_size" in qc and qc["weight_block_size"] is not None:
            block = block_size(qc["weight_block_size"], "quantization_config.weight_block_size")
            weight = st.fp8_per_block(block, scale_fmt)
        else:
            weight = st.fp8_per_tensor()
        patterns: tuple[Pattern, ...] = ()
        for key in ("modules_to_not_convert", "ignored_layers"):
            patterns += parse_patterns(qc.get(key), f"quantization_config.{key}")
        return cls(weight, patterns, qc.get("activation_scheme"))

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        excluded = self._excluded(module, dtype, self.not_converted, "modules_to_not_convert/ignored_layers")
        if excluded is not None:
            return excluded
        return KvBStorage(self.weight, "the fp8 config quantizes every linear it does not list", False)

    def describe(self) -> str:
        act = f", {self.activation_scheme} activations" if self.activation_scheme else ""
        return f"fp8 ({self.weight.detail}{act}; {len(self.not_converted)} modules not converted)"
