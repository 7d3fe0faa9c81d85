"""``quant_method: compressed-tensors`` — llm-compressor checkpoints.

``config_groups`` map a group name to ``{"targets": [...], "weights": {...}, "input_activations":
{...}}``; a target is an exact module name, a ``re:`` regex, or a module CLASS name such as
``Linear`` (vLLM matches a class-name target when it is contained in the layer's class name, so
``Linear`` covers every linear layer, kv_b_proj included). ``ignore`` lists exact names and ``re:``
regexes. The first group whose targets match a layer decides it; a layer no group targets stays
unquantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlaq.policy import stored as st
from mlaq.policy.checkpoint import CheckpointQuant, KvBStorage, block_size, mapping
from mlaq.policy.patterns import Pattern, PatternKind, parse_patterns

KV_B_PROJ_CLASS = "Linear"  # kv_b_proj is a linear layer in every engine


def _target_covers(target: Pattern, module: str) -> bool:
    if target.covers(module):
        return True
    # A dot-free non-regex target is a class name (``Linear``): vLLM's "contains" check.
    return (
        target.kind is PatternKind.EXACT
        and "." not in target.text
        and target.text.lower() in KV_B_PROJ_CLASS.lower()
    )


def stored_format(group: Mapping[str, Any], dtype: str, where: str) -> st.StoredFormat:
    """The stored format a config group describes."""
    w = mapping(group.get("weights"), f"{where}.weights")
    act = mapping(group.get("input_activations"), f"{where}.input_activations")
    if not w:
        return st.unquantized(dtype)
    kind, bits, strategy = w.get("type"), w.get("num_bits"), w.get("strategy")
    group_size = w.get("group_size")
    if kind == "float" and bits == 8:
        if strategy == "tensor":
            return st.fp8_per_tensor()
        if strategy == "channel":
            return st.fp8_per_channel()
        if strategy == "block":
            return st.fp8_per_block(block_size(w.get("block_structure"), f"{where}.weights.block_structure"))
        return st.unsupported("fp8", f"FP8 {strategy} (group {group_size})")
    if kind == "float" and bits == 4:
        if group_size == 32:
            return st.mxfp4(activations_fp4=act.get("type") == "float" and act.get("num_bits") == 4)
        if group_size == 16:
            return st.unsupported("nvfp4", "NVFP4 (e2m1, e4m3 scale per 16, fp32 global scale)")
        return st.unsupported("fp4", f"FP4 {strategy} group {group_size}")
    return st.unsupported(f"{kind}{bits}", f"{kind} {bits}-bit {strategy}")


@dataclass(frozen=True)
class CompressedTensorsQuant(CheckpointQuant):
    groups: tuple[tuple[str, tuple[Pattern, ...], Mapping[str, Any]], ...]
    ignore: tuple[Pattern, ...]
    method: str = "compressed-tensors"

    @classmethod
    def parse(cls, qc: Mapping[str, Any]) -> CompressedTensorsQuant:
        groups_cfg = mapping(qc.get("config_groups"), "quantization_config.config_groups")
        groups = []
        for name, group in groups_cfg.items():
            where = f"quantization_config.config_groups[{name!r}]"
            group = mapping(group, where)
            groups.append((str(name), parse_patterns(group.get("targets"), f"{where}.targets"), group))
        ignore = parse_patterns(qc.get("ignore"), "quantization_config.ignore")
        return cls(tuple(groups), ignore)

    def kv_b_proj(self, module: str, dtype: str) -> KvBStorage:
        excluded = self._excluded(module, dtype, self.ignore, "ignore")
        if excluded is not None:
            return excluded
        for name, targets, group in self.groups:
            hit = next((t for t in targets if _target_covers(t, module)), None)
            if hit is not None:
                fmt = stored_format(group, dtype, f"config_groups[{name!r}]")
                because = f"config_groups[{name!r}] targets {hit.text!r}"
                return KvBStorage(fmt, because, not fmt.quantized)
        return KvBStorage(st.unquantized(dtype), "no config_groups entry targets it", True)

    def describe(self) -> str:
        parts = [f"{name}: {stored_format(g, 'bf16', name).detail}" for name, _, g in self.groups]
        return f"compressed-tensors ({'; '.join(parts) or 'no config groups'}; {len(self.ignore)} ignore patterns)"
