"""NVIDIA ModelOpt checkpoints: ``hf_quant_config.json`` or ``quant_method: modelopt``.

``{"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
"exclude_modules": ["lm_head", "model.layers.0.self_attn*", ...]}}``. ``exclude_modules`` entries
are shell globs (``ignore`` in newer exports). ``quant_algo: MIXED_PRECISION`` names an algorithm
per module under ``quantized_layers``. Algorithm names are TensorRT-LLM's ``QuantAlgo``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.policy import stored as st
from mlaq.policy.checkpoint import CheckpointQuant, KvBStorage, mapping
from mlaq.policy.patterns import Pattern, parse_patterns

_ALGOS: dict[str, Callable[[], st.StoredFormat]] = {
    "FP8": st.fp8_per_tensor,
    "FP8_PER_CHANNEL_PER_TOKEN": st.fp8_per_channel,
    "FP8_BLOCK_SCALES": lambda: st.fp8_per_block((128, 128)),
    "MXFP8": st.mxfp8,
    "W4A16_MXFP4": lambda: st.mxfp4(activations_fp4=False),
    "NVFP4": lambda: st.unsupported("nvfp4", "NVFP4 (e2m1, e4m3 scale per 16, fp32 global scale)"),
}


def algo_format(algo: str) -> st.StoredFormat:
    make = _ALGOS.get(algo)
    if make is not None:
        return make()
    return st.unsupported(algo.lower(), f"ModelOpt {algo}")


@dataclass(frozen=True)
class ModelOptQuant(CheckpointQuant):
    quant_algo: str | None
    exclude: tuple[Pattern, ...]
    per_layer: tuple[tuple[Pattern, str], ...]  # MIXED_PRECISION: module -> quant_algo
    group_size: int | None
    source: str  # "hf_quant_config.json" or "config.json"
    method: str = "modelopt"

    @classmethod
    def parse(cls, raw: Mapping[str, Any], source: str) -> ModelOptQuant:
        q = mapping(raw.get("quantization", raw), f"{source}: quantization")
        algo = q.get("quant_algo")
        if algo is not None and not isinstance(algo, str):
            raise ValueError(f"{source}: quant_algo must be a string or null, got {algo!r}")
        exclude = parse_patterns(q.get("exclude_modules"), f"{source}: exclude_modules")
        exclude += parse_patterns(q.get("ignore"), f"{source}: ignore")
        per_layer: list[tuple[Pattern, str]] = []
        where = f"{source}: quantized_layers"
        for name, cfg in mapping(q.get("quantized_layers"), where).items():
            layer_algo = mapping(cfg, f"{where}[{name!r}]").get("quant_algo")
            per_layer.append((Pattern.parse(name, where), str(layer_algo)))
        return cls(algo, exclude, tuple(per_layer), q.get("group_size"), source)

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        excluded = self._excluded(module, dtype, self.exclude, "exclude_modules")
        if excluded is not None:
            return excluded
        if self.quant_algo == "MIXED_PRECISION":
            hit = next(((p, a) for p, a in self.per_layer if p.covers(module)), None)
            if hit is None:
                return KvBStorage(st.unquantized(dtype), "quantized_layers does not list it", True)
            fmt = algo_format(hit[1])
            return KvBStorage(fmt, f"quantized_layers[{hit[0].text!r}] is {hit[1]}", not fmt.quantized)
        if self.quant_algo is None:
            return KvBStorage(st.unquantized(dtype), "quant_algo is null (weights not quantized)", True)
        return KvBStorage(algo_format(self.quant_algo), f"quant_algo {self.quant_algo} applies", False)

    def describe(self) -> str:
        group = f", group {self.group_size}" if self.group_size else ""
        return f"modelopt {self.quant_algo}{group} ({self.source}; {len(self.exclude)} exclude_modules)"
