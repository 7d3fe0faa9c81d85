"""mlaq's decision for every MLA layer of the model vLLM is building, and what the plugin does to each.

The decision is mlaq's policy (``mlaq.policy.decide``) on the checkpoint vLLM loads: the same call as
``mlaq explain MODEL --platform P`` (policy mode) or ``mlaq explain MODEL --quantization-config TARGETS``
(emulate mode). This module turns it into one :class:`LayerAction` per layer and the lines the plugin
logs; it imports nothing of vLLM (the vLLM facts come in as arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlaq.integrations.vllm.config import Mode, PluginConfig
from mlaq.policy import LayerDecision, PolicyResult, Rule, decide, read_checkpoint_dir
from mlaq.policy.detect import checkpoint_quant
from mlaq.policy.model_config import CheckpointFiles, layer_ranges, mla_model
from mlaq.policy.report import fold
from mlaq.settings import Platform, Settings, VllmPluginEnv

AITER_FP8 = ("fp8_per_tensor", "fp8_per_tensor_fnuz")  # AITER's FP8 BMM: one scale per batched tensor
AITER_FP4 = ("mxfp4",)  # AITER's batched_gemm_a16wfp4 with prequant: W4A4 MXFP4


@dataclass(frozen=True)
class Kernels:
    """What vLLM can run here (vllm/_aiter_ops.py ``rocm_aiter_ops.is_fp8bmm_enabled`` /
    ``is_fp4bmm_enabled``: AITER on, the BMM flag on, CDNA 3+ / CDNA 4)."""

    platform: Platform
    fp8bmm: bool
    fp4bmm: bool


@dataclass(frozen=True)
class LayerAction:
    """One layer: vLLM's two flags (policy mode) or the scheme to emulate (emulate mode), and why."""

    layer: int
    fp8bmm: bool = False
    fp4bmm: bool = False
    emulate: str | None = None  # an mlaq scheme name: the two BMMs run it (emulate mode)
    online: str | None = None  # a vLLM shorthand: kv_b_proj's linear quantized online (vLLM's meaning)
    note: str = ""  # where vLLM runs something other than mlaq's decision: what, and why


@dataclass(frozen=True)
class Plan:
    config: PluginConfig
    result: PolicyResult
    actions: tuple[LayerAction, ...]

    def lines(self) -> list[str]:
        """The log: the setting, one line per group of layers with mlaq's reason, then the layers where
        vLLM runs something else."""
        out = [f"mlaq plugin: {self.config.describe()}; {len(self.actions)} MLA layers"]
        for row in fold(self.result.layers):
            out.append(f"mlaq plugin: layers {row.layers}: {row.scheme} (rule {row.rule}): {row.reason}")
        notes: dict[str, list[int]] = {}
        for a in self.actions:
            if a.note:
                notes.setdefault(a.note, []).append(a.layer)
        out += [f"mlaq plugin: layers {layer_ranges(ls)}: {note}" for note, ls in notes.items()]
        _, summary = self.result.summary()
        return [*out, f"mlaq plugin: {summary}"]


def checkpoint_files(model: str, hf_config: Mapping[str, Any]) -> CheckpointFiles:
    """The checkpoint's config files: read from its directory when vLLM loads a local one (ModelOpt's
    hf_quant_config.json and the weights' layer prefix too), else vLLM's parsed config."""
    if Path(model).is_dir() and (Path(model) / "config.json").is_file():
        return read_checkpoint_dir(model)
    return CheckpointFiles(Path(model), hf_config, None, "model.layers")


def _policy_action(d: LayerDecision, k: Kernels) -> LayerAction:
    fp4 = d.scheme in AITER_FP4 and d.requantized
    fp8 = d.scheme in AITER_FP8 and d.requantized
    if fp4 and not k.fp4bmm:
        return LayerAction(d.layer, note=f"vLLM cannot run {d.scheme} here ({_missing(k, 'FP4')}): bf16 kept")
    if fp8 and not k.fp8bmm:
        return LayerAction(d.layer, note=f"vLLM cannot run {d.scheme} here ({_missing(k, 'FP8')}): bf16 kept")
    if fp4 or fp8:
        return LayerAction(d.layer, fp8bmm=fp8, fp4bmm=fp4)
    if d.uses_checkpoint_data:
        return LayerAction(
            d.layer,
            note=f"vLLM 0.32 has no BMM kernel for the stored {d.scheme}: it runs the dequantized weight in "
            "bf16 (mlaq's engine runs the stored format)",
        )
    if d.requantized:
        return LayerAction(
            d.layer,
            note=f"vLLM 0.32 has no BMM kernel for {d.scheme}: bf16 kept (mode emulate runs it exactly)",
        )
    return LayerAction(d.layer)  # the checkpoint's own unquantized weight: vLLM's plain BMMs


def _missing(k: Kernels, which: str) -> str:
    if k.platform not in (Platform.ROCM_GFX942, Platform.ROCM_GFX950):
        return f"AITER's BMMs exist only on ROCm, this is {k.platform}"
    if which == "FP4" and k.platform is not Platform.ROCM_GFX950:
        return f"AITER's FP4 BMM needs gfx950 (CDNA 4), this is {k.platform}"
    return f"rocm_aiter_ops.is_{which.lower()}bmm_enabled() is False: set VLLM_ROCM_USE_AITER=1"


def make_plan(
    config: PluginConfig,
    files: CheckpointFiles,
    env: VllmPluginEnv,
    kernels: Kernels,
) -> Plan:
    """Decide every layer once (config files only) and turn the decisions into actions."""
    model = mla_model(files.config, files.layers_prefix)
    if config.mode is Mode.POLICY:
        settings = Settings(fp8bmm=env.fp8bmm is True, fp4bmm=env.fp4bmm is True, platform=kernels.platform)
    else:
        settings = Settings()  # mlaq's emulation: every scheme exists, on any device
    result = decide(model, checkpoint_quant(files), settings, config.explicit)
    if config.mode is Mode.POLICY:
        actions = tuple(_policy_action(d, kernels) for d in result.layers)
    else:
        actions = tuple(
            LayerAction(
                d.layer,
                emulate=d.scheme if d.rule is Rule.TARGETS and d.online is None else None,
                online=d.online,
            )
            for d in result.layers
        )
    return Plan(config, result, actions)
