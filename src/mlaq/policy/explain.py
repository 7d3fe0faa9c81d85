"""``mlaq explain`` as a library call: the decision for the chosen engine, and for ``--engine-defaults
vllm-0.32`` / ``sglang-0.5.23`` the comparison with the other engines' decisions on the same platform."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlaq.bmm.tp import head_shards, spans_heads
from mlaq.policy.decide import decide_from_dir
from mlaq.policy.explicit import ExplicitConfig
from mlaq.policy.model_config import layer_ranges
from mlaq.policy.report import format_comparison, format_explain
from mlaq.policy.result import PolicyResult
from mlaq.policy.sglang0523 import SglangCrash
from mlaq.settings import Engine, Platform, Settings

ROCM = (Platform.ROCM_GFX942, Platform.ROCM_GFX950)
AITER_VARIABLE = {Engine.VLLM_032: "VLLM_ROCM_USE_AITER", Engine.SGLANG_0523: "SGLANG_USE_AITER"}


@dataclass(frozen=True)
class Explanation:
    result: PolicyResult  # what the chosen engine runs
    mlaq: PolicyResult | None = None  # an engine's defaults: mlaq's own decision on the same platform
    aiter_on: PolicyResult | str | None = None  # ... and the engine with its AITER switch set when it was
    # unset (a str: the crash SGLang reports then)
    vllm: PolicyResult | None = None  # engine sglang-0.5.23: vLLM 0.32's decision on the same platform
    tensor_parallel_size: int = 1  # --tensor-parallel-size: scales per rank's shard of the heads

    def text(self, model_path: str, weights: str | None = None) -> str:
        out = format_explain(self.result, model_path, weights)
        if self.tensor_parallel_size > 1:
            out += "\n" + "\n".join(tp_lines(self.result, self.tensor_parallel_size))
        if self.mlaq is not None:
            out += "\n" + format_comparison(self.result, self.mlaq, self.aiter_on, self.vllm)
        return out

    def to_json(self) -> dict[str, Any]:
        out = self.result.to_json()
        if self.tensor_parallel_size > 1:
            out["tensor_parallel_size"] = self.tensor_parallel_size
        if self.mlaq is not None:
            out["mlaq"] = self.mlaq.to_json()
        if self.vllm is not None:
            out["vllm-0.32"] = self.vllm.to_json()
        if self.aiter_on is not None:
            key = f"with_{AITER_VARIABLE[self.result.settings.engine]}=1"
            out[key] = self.aiter_on if isinstance(self.aiter_on, str) else self.aiter_on.to_json()
        return out


def _aiter_on(
    path: str | Path, settings: Settings, quant_config: ExplicitConfig | str | None
) -> PolicyResult | str | None:
    """The engine with its AITER master switch set, where it is unset on ROCm (AMD's recipes set it)."""
    if settings.platform not in ROCM:
        return None
    if settings.engine is Engine.VLLM_032 and settings.vllm is not None and not settings.vllm.aiter:
        on = replace(settings, vllm=replace(settings.vllm, aiter=True))
    elif settings.engine is Engine.SGLANG_0523 and settings.sglang is not None and not settings.sglang.aiter:
        on = replace(settings, sglang=replace(settings.sglang, aiter=True))
    else:
        return None
    try:
        return decide_from_dir(path, on, quant_config, log=False)
    except SglangCrash as crash:
        return str(crash)


def explain(
    path: str | Path,
    settings: Settings,
    quant_config: ExplicitConfig | str | None = None,
    tensor_parallel_size: int = 1,
) -> Explanation:
    """Decide every layer of the checkpoint in ``path`` (config files only; no weights)."""
    result = decide_from_dir(path, settings, quant_config, log=False)
    if tensor_parallel_size > 1:
        tp_lines(result, tensor_parallel_size)  # refuses a size that does not divide the heads
    if settings.engine is Engine.MLAQ:
        return Explanation(result, tensor_parallel_size=tensor_parallel_size)
    mlaq = replace(settings, engine=Engine.MLAQ, vllm=None, sglang=None)
    own = decide_from_dir(path, mlaq, quant_config, log=False)
    vllm = None
    if settings.engine is Engine.SGLANG_0523:
        vllm = decide_from_dir(path, replace(settings, engine=Engine.VLLM_032, sglang=None), None, log=False)
    aiter_on = _aiter_on(path, settings, quant_config)
    return Explanation(result, own, aiter_on, vllm, tensor_parallel_size)


def tp_lines(result: PolicyResult, tp_size: int) -> list[str]:
    """What ``--tensor-parallel-size`` changes: the ranks' heads, and which layers' scales are per shard."""
    heads = result.model.num_attention_heads
    if heads == 0:
        raise ValueError("--tensor-parallel-size: config.json has no num_attention_heads to split")
    shards = head_shards(heads, tp_size)
    ranks = ", ".join(f"rank {r}: heads [{a}, {b})" for r, (a, b) in enumerate(shards))
    lines = [
        f"tensor parallel: {tp_size} ranks ({ranks}; kv_b_proj's output rows split as vLLM's "
        "ColumnParallelLinear); per-tensor scales are computed per shard, as the kernels do on each rank"
    ]
    spanning = [d.layer for d in result.layers if not d.uses_checkpoint_data and spans_heads(d.scheme)]
    if spanning:
        lines.append(
            f"per-shard scales: layers {layer_ranges(spanning)} ({tp_size} scales per BMM weight instead of "
            "one); every other layer's scales stay inside a head and are the same at any size"
        )
    else:
        lines.append(
            "per-shard scales: no layer's scheme has a scale spanning heads: the same bits at any size"
        )
    return lines
