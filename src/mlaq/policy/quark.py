"""``quant_method: quark`` — AMD Quark checkpoints (MXFP4, FP8, ...).

A layer's spec is found as vLLM's QuarkConfig finds it: ``exclude`` first (exact names, ``re:``
regexes, ``*`` globs), then ``layer_quant_config`` (glob keys), then ``layer_type_quant_config``
(``Linear``), then ``global_quant_config``. A spec is ``{"weight": {...}, "input_tensors": {...}}``;
``weight: null`` leaves the layer unquantized.

Family opt-in (engines.md): Quark checkpoints of the DeepSeek-V3 family (model_type deepseek_v3 /
deepseek_v32) whose GLOBAL weight dtype is fp4 intend dynamic MXFP4 for the attention they exclude.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.policy import stored as st
from mlaq.policy.checkpoint import CheckpointQuant, KvBStorage, mapping
from mlaq.policy.patterns import Pattern, parse_patterns

DEEPSEEK_V3_FAMILY = ("deepseek_v3", "deepseek_v32")


def _dtype(spec: Mapping[str, Any] | None) -> str | None:
    """A tensor spec's element dtype; older Quark writes ``dtype: mx`` + ``mx_element_dtype``."""
    if not spec:
        return None
    dtype = spec.get("dtype")
    if dtype == "mx":
        dtype = spec.get("mx_element_dtype")
    return None if dtype is None else str(dtype)


def _is_mx(spec: Mapping[str, Any]) -> bool:
    """OCP MX: groups of 32 with e8m0 (power-of-two) scales."""
    mx_dtype = spec.get("dtype") == "mx"
    group = spec.get("qscheme") == "per_group" and spec.get("group_size") == 32
    return mx_dtype or (group and spec.get("scale_format") == "e8m0")


def stored_format(spec: Mapping[str, Any], dtype: str, where: str) -> st.StoredFormat:
    """The stored format a Quark layer spec describes."""
    weight = mapping(spec.get("weight"), f"{where}.weight")
    inputs = mapping(spec.get("input_tensors"), f"{where}.input_tensors")
    w = _dtype(weight)
    if w is None:
        return st.unquantized(dtype)
    qscheme = weight.get("qscheme")
    if w == "fp4":
        if _is_mx(weight):
            return st.mxfp4(activations_fp4=_dtype(inputs) == "fp4")
        return st.unsupported("fp4", f"FP4 {qscheme} group {weight.get('group_size')} (not OCP MXFP4)")
    if w in ("fp8_e4m3", "fp8"):
        if _is_mx(weight):
            return st.mxfp8()
        if qscheme == "per_tensor":
            return st.fp8_per_tensor()
        if qscheme == "per_channel":
            return st.fp8_per_channel()
        return st.unsupported("fp8", f"FP8 {qscheme} group {weight.get('group_size')}")
    return st.unsupported(w, f"Quark {w} {qscheme}")


@dataclass(frozen=True)
class QuarkQuant(CheckpointQuant):
    global_spec: Mapping[str, Any]
    exclude: tuple[Pattern, ...]
    layer_specs: tuple[tuple[Pattern, Mapping[str, Any]], ...]
    linear_spec: Mapping[str, Any] | None  # layer_type_quant_config entry for Linear layers
    method: str = "quark"

    @classmethod
    def parse(cls, qc: Mapping[str, Any]) -> QuarkQuant:
        glob = mapping(qc.get("global_quant_config"), "quantization_config.global_quant_config")
        exclude = parse_patterns(qc.get("exclude"), "quantization_config.exclude")
        layer_cfg = mapping(qc.get("layer_quant_config"), "quantization_config.layer_quant_config")
        where = "quantization_config.layer_quant_config"
        layer_specs = tuple(
            (Pattern.parse(k, f"{where} key"), mapping(v, f"{where}[{k!r}]")) for k, v in layer_cfg.items()
        )
        type_cfg = mapping(qc.get("layer_type_quant_config"), "quantization_config.layer_type_quant_config")
        linear = next((v for k, v in type_cfg.items() if str(k).split(".")[-1] == "Linear"), None)
        return cls(glob, exclude, layer_specs, linear)

    @property
    def global_weight_dtype(self) -> str | None:
        return _dtype(mapping(self.global_spec.get("weight"), "global_quant_config.weight"))

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        excluded = self._excluded(module, dtype, self.exclude, "exclude")
        if excluded is not None:
            return excluded
        spec, because = self.global_spec, "global_quant_config applies"
        for pattern, layer_spec in self.layer_specs:
            if pattern.covers(module):
                spec, because = layer_spec, f"layer_quant_config[{pattern.text!r}] applies"
                break
        else:
            if self.linear_spec is not None:
                spec, because = self.linear_spec, "layer_type_quant_config for Linear applies"
        fmt = stored_format(spec, dtype, "quantization_config")
        return KvBStorage(fmt, because, not fmt.quantized)

    def family_opt_in(self, model_type: str) -> bool:
        return model_type in DEEPSEEK_V3_FAMILY and self.global_weight_dtype == "fp4"

    def describe(self) -> str:
        fmt = stored_format(self.global_spec, "bf16", "global_quant_config")
        return f"quark (global: {fmt.detail}; {len(self.exclude)} exclude patterns)"
