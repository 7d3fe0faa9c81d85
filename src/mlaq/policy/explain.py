"""``mlaq explain`` as a library call: the decision for the chosen engine, and for ``--engine-defaults
vllm-0.32`` / ``sglang-0.5.23`` the comparison with the other engines' decisions on the same platform."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlaq.policy.decide import decide_from_dir
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

    def text(self, model_path: str, weights: str | None = None) -> str:
        out = format_explain(self.result, model_path, weights)
        if self.mlaq is not None:
            out += "\n" + format_comparison(self.result, self.mlaq, self.aiter_on, self.vllm)
        return out

    def to_json(self) -> dict[str, Any]:
        out = self.result.to_json()
        if self.mlaq is not None:
            out["mlaq"] = self.mlaq.to_json()
        if self.vllm is not None:
            out["vllm-0.32"] = self.vllm.to_json()
        if self.aiter_on is not None:
            key = f"with_{AITER_VARIABLE[self.result.settings.engine]}=1"
            out[key] = self.aiter_on if isinstance(self.aiter_on, str) else self.aiter_on.to_json()
        return out


def _aiter_on(path: str | Path, settings: Settings, quant_config: str | None) -> PolicyResult | str | None:
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


def explain(path: str | Path, settings: Settings, quant_config: str | None = None) -> Explanation:
    """Decide every layer of the checkpoint in ``path`` (config files only; no weights)."""
    result = decide_from_dir(path, settings, quant_config, log=False)
    if settings.engine is Engine.MLAQ:
        return Explanation(result)
    mlaq = replace(settings, engine=Engine.MLAQ, vllm=None, sglang=None)
    own = decide_from_dir(path, mlaq, quant_config, log=False)
    vllm = None
    if settings.engine is Engine.SGLANG_0523:
        vllm = decide_from_dir(path, replace(settings, engine=Engine.VLLM_032, sglang=None), None, log=False)
    return Explanation(result, own, _aiter_on(path, settings, quant_config), vllm)
