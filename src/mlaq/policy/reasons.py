"""One-sentence reasons, one function per rule, in words a user understands."""

from __future__ import annotations

from mlaq.bmm.online_linear import prefill_activation
from mlaq.policy.checkpoint import KvBStorage
from mlaq.policy.stored import UNQUANTIZED, fnuz_variant
from mlaq.settings import Settings


def flags_on(settings: Settings) -> str:
    """``"MLAQ_FP4BMM=1 and MLAQ_FP8BMM=1"``, one of them, or ``""``."""
    on = [v for v, flag in (("MLAQ_FP4BMM=1", settings.fp4bmm), ("MLAQ_FP8BMM=1", settings.fp8bmm)) if flag]
    return " and ".join(on)


def _fp16_note(source: str, scheme: str) -> str:
    return " (no fp16 scheme is registered; fp32 holds fp16 exactly)" if source != scheme == "fp32" else ""


def _split_note(storage: KvBStorage, fnuz: bool = False) -> str:
    """Where W_UK cannot run the stored format under ``scheme`` (per-channel FP8), say what it runs as."""
    stored = storage.stored
    if stored.scheme_uk is None:
        return ""
    uk, uv = stored.scheme_uk, stored.scheme
    if fnuz:
        uk, uv = fnuz_variant(uk) or uk, fnuz_variant(uv) or uv
    return (
        f" (q absorption's W_UK runs as {uk} on the same codes and scales: its per-channel "
        f"scales lie along its reduction axis, which a per-channel kernel cannot scale; the V up-projection "
        f"runs as {uv})"
    )


def targets(pattern: str, scheme: str, storage: KvBStorage, method: str) -> str:
    stored = storage.stored
    head = f"--quantization-config targets {pattern!r} chose {scheme}"
    if not stored.known:
        return f"{head}; the checkpoint's quant_method {method!r} is not one mlaq reads, so it is used as stored."
    if stored.quantized and scheme == stored.scheme:
        return (
            f"{head}, the checkpoint's own format ({stored.detail}): stored codes and scales run "
            f"unchanged{_split_note(storage)}."
        )
    if stored.quantized and scheme == fnuz_variant(stored.scheme):
        return (
            f"{head}, the checkpoint's own format ({stored.detail}) converted exactly to e4m3fnuz for AMD "
            f"gfx942 as vLLM's normalize_e4m3fn_to_e4m3fnuz does (same bytes, -0 to 0, scales doubled), not "
            f"re-quantized{_split_note(storage, fnuz=True)}."
        )
    if scheme in UNQUANTIZED:
        if stored.quantized:
            return f"{head}: the checkpoint's {stored.detail} weight is dequantized and runs in {scheme}."
        return f"{head}: the {stored.name} weight runs in {scheme}."
    if stored.quantized:
        return f"{head}: the checkpoint's {stored.detail} weight is dequantized and re-quantized online."
    return f"{head}: the {stored.name} weight is quantized to {scheme} online."


def ignore(pattern: str, storage: KvBStorage) -> str:
    return (
        f"--quantization-config ignore {pattern!r} exempts it from online re-quantization: "
        f"it keeps the checkpoint's {storage.stored.detail}{_split_note(storage)}."
    )


def checkpoint(scheme: str, storage: KvBStorage, settings: Settings) -> str:
    flags = flags_on(settings)
    verb = "apply" if settings.fp4bmm and settings.fp8bmm else "applies"
    tail = f"; {flags} {verb} only to unquantized weights" if flags else ""
    if scheme == fnuz_variant(storage.stored.scheme):
        tail = (
            f"; on {settings.platform} converted exactly to e4m3fnuz as vLLM's normalize_e4m3fn_to_e4m3fnuz "
            f"does (same bytes, -0 to 0, scales doubled){tail}"
        )
    data = "stored MXFP4 values" if storage.stored.name == "mxfp4" else "stored codes and scales"
    return (
        f"The checkpoint stores it as {storage.stored.detail}, since {storage.because}: it runs as {scheme} "
        f"on the {data}, not re-quantized{_split_note(storage)}{tail}."
    )


def default(scheme: str, storage: KvBStorage, has_config: bool, settings: Settings) -> str:
    src = storage.stored.name
    note = _fp16_note(src, scheme)
    if settings.fp4bmm:  # reached only when FP4 cannot apply and FP8 is off
        return f"MLAQ_FP4BMM=1 needs a bf16/fp16 source and this weight is {src}, so it stays {scheme}{note}."
    if has_config:
        return f"The checkpoint keeps it {src} ({storage.because}) and no BMM flag is set: it runs in {scheme}{note}."
    return (
        "No BMM flag is set (MLAQ_FP8BMM and MLAQ_FP4BMM are off by default): "
        f"it runs at the checkpoint's {src}{note}."
    )


def guard(scheme: str, storage: KvBStorage, method: str, settings: Settings) -> str:
    src = storage.stored.name
    return (
        f"The checkpoint's {method} config leaves it unquantized ({storage.because}) so that it stays {src}: "
        f"{flags_on(settings)} not applied, it runs in {scheme}{_fp16_note(src, scheme)}."
    )


def family(scheme: str, var: str, storage: KvBStorage, model_type: str) -> str:
    text = (
        f"Quark MXFP4 checkpoints of the DeepSeek-V3 family ({model_type}) leave attention unquantized "
        f"({storage.because}) for dynamic MXFP4 at run time: {var}=1 re-quantizes the "
        f"{storage.stored.name} weight to {scheme}"
    )
    if scheme != "mxfp4":
        text += " (set MLAQ_FP4BMM=1 for the MXFP4 the checkpoint intends)"
    return text + "."


def flag(scheme: str, var: str, storage: KvBStorage, settings: Settings) -> str:
    src = storage.stored.name
    pre = ""
    if var == "MLAQ_FP8BMM" and settings.fp4bmm:
        pre = f"MLAQ_FP4BMM=1 needs a bf16/fp16 source and this weight is {src}, so "
    text = f"{var}=1 re-quantizes the {src} weight to {scheme} online; the checkpoint has no quantization config."
    return pre + text


def platform_blocked(scheme: str, storage: KvBStorage, blocked: str, settings: Settings) -> str:
    """A flag that is on names an AITER kernel the platform does not have (derivations in platform.py)."""
    where = {
        "rocm-gfx942": "the FP4 BMM needs CDNA 4 (gfx950)",
        "cuda": "AITER's BMMs exist only on ROCm gfx942/gfx950",
        "cpu": "AITER's BMMs exist only on ROCm gfx942/gfx950",
    }.get(str(settings.platform), "")
    return (
        f"{blocked} names an AITER BMM that vLLM 0.32 does not run on {settings.platform} ({where}; "
        f"vllm/_aiter_ops.py): it runs at the checkpoint's {storage.stored.name} as {scheme}{_fp16_note(storage.stored.name, scheme)}."
    )


def online_linear(pattern: str, online: str, storage: KvBStorage) -> str:
    """``--quantization online`` targets: vLLM's meaning, the kv_b_proj linear quantized online."""
    return (
        f"--quantization online: targets {pattern!r} quantize the kv_b_proj linear to {online} as vLLM 0.32 "
        f"does (its {storage.stored.detail} weight; prefill runs it, {prefill_activation(online)} as on sm90); "
        "the absorbed BMMs run bf16 on its "
        "dequantized weight (split_kv_b_proj -> get_and_maybe_dequant_weights)."
    )
