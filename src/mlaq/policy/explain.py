"""``mlaq explain`` as a library call: the decision for the chosen engine, and for ``--engine-defaults
vllm-0.32`` the comparison with mlaq's own decision on the same platform."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from mlaq.policy.decide import decide_from_dir
from mlaq.policy.report import format_comparison, format_explain
from mlaq.policy.result import PolicyResult
from mlaq.settings import Engine, Platform, Settings


@dataclass(frozen=True)
class Explanation:
    result: PolicyResult  # what the chosen engine runs
    mlaq: PolicyResult | None = None  # engine vllm-0.32: mlaq's own decision on the same platform
    aiter_on: PolicyResult | None = None  # ... and vLLM with VLLM_ROCM_USE_AITER=1 when it was unset

    def text(self, model_path: str, weights: str | None = None) -> str:
        out = format_explain(self.result, model_path, weights)
        if self.mlaq is not None:
            out += "\n" + format_comparison(self.result, self.mlaq, self.aiter_on)
        return out

    def to_json(self) -> dict[str, Any]:
        out = self.result.to_json()
        if self.mlaq is not None:
            out["mlaq"] = self.mlaq.to_json()
        if self.aiter_on is not None:
            out["with_VLLM_ROCM_USE_AITER=1"] = self.aiter_on.to_json()
        return out


def explain(path: str | Path, settings: Settings, quant_config: str | None = None) -> Explanation:
    """Decide every layer of the checkpoint in ``path`` (config files only; no weights)."""
    result = decide_from_dir(path, settings, quant_config, log=False)
    if settings.engine is not Engine.VLLM_032:
        return Explanation(result)
    assert settings.vllm is not None
    own = decide_from_dir(path, replace(settings, engine=Engine.MLAQ, vllm=None), quant_config, log=False)
    aiter_on = None
    if settings.platform in (Platform.ROCM_GFX942, Platform.ROCM_GFX950) and not settings.vllm.aiter:
        on = replace(settings, vllm=replace(settings.vllm, aiter=True))
        aiter_on = decide_from_dir(path, on, quant_config, log=False)
    return Explanation(result, own, aiter_on)
