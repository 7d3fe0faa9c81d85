"""How a checkpoint stores one kv_b_proj weight, and which mlaq BMM scheme runs that format exactly.

``name`` is what reports show as the *source* precision. ``scheme`` is the scheme that computes with
the checkpoint's own codes and scales, without re-rounding them (rule ``checkpoint``):

=================  ===============  =============================================================
stored             scheme           note
=================  ===============  =============================================================
bf16 / fp32        bf16 / fp32      unquantized
fp16               fp16 or fp32     fp32 when no fp16 scheme is registered (holds fp16 exactly)
fp8_per_block      fp8_per_block    e4m3 + one fp32 scale per (128 x 128) block (DeepSeek/GLM FP8)
fp8_per_channel    fp8_per_channel  e4m3 + one scale per output row; W_UK runs as fp8_per_block (below)
fp8_per_tensor     fp8_per_tensor   e4m3 + one scale for the whole weight
mxfp4              mxfp4            OCP MXFP4 (e2m1, e8m0 scale per 32) with MXFP4 activations (W4A4,
                                    Quark's ``input_tensors: fp4``); mxfp4_w4a16 when the checkpoint
                                    declares no activation quantization
mxfp8              mxfp8            OCP MXFP8 (e4m3, e8m0 scale per 32)
nvfp4, int4, ...   none             no mlaq scheme runs these exactly: choose one with targets
=================  ===============  =============================================================

MXFP4 caveat: a checkpoint's MXFP4 groups run along kv_b_proj's input axis (kv_lora_rank L). That
is the reduction axis K of the V up-projection (W_UV^T, (N, L, V)), so its stored codes and scales
are used as they are; for q absorption (W_UK, (N, P, L)) K is P, so a kernel that groups along K
must regroup W_UK — the scheme's ``prepare`` does that from the exactly dequantized weight.

Per-channel FP8 caveat: the scale is per OUTPUT ROW of kv_b_proj [N*(P+V), L]. W_UV^T (N, L, V) has
it per output column M — the AITER per-channel epilogue, ``fp8_per_channel``. For W_UK (N, P, L) the
rows are the reduction axis K = P, and no per-channel kernel applies a weight scale varying along
K; ``fp8_per_block``'s per-K-segment scaling does, exactly, so W_UK runs as ``scheme_uk`` =
``fp8_per_block`` on the same stored codes and scales. Nothing is re-quantized either way.
"""

from __future__ import annotations

from dataclasses import dataclass

UNQUANTIZED = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class StoredFormat:
    """The checkpoint's format for one kv_b_proj weight."""

    name: str  # "bf16", "fp8_per_block", "mxfp4", "nvfp4", ...
    detail: str  # one phrase for humans: "FP8 e4m3 with 128x128 block scales (ue8m0)"
    scheme: str | None  # the mlaq scheme that runs exactly this format, None if none does
    block_size: tuple[int, int] | None = None  # fp8_per_block: (rows, cols) of one scale block
    scale_fmt: str | None = None  # e.g. "ue8m0" when block scales are powers of two
    scheme_uk: str | None = None  # W_UK's scheme when it must differ from ``scheme`` (per-channel FP8)

    @property
    def quantized(self) -> bool:
        return self.name not in UNQUANTIZED

    @property
    def known(self) -> bool:
        """False when the checkpoint's quantization method is one mlaq cannot read."""
        return self.name != "unknown"


def fnuz_variant(scheme: str | None) -> str | None:
    """The e4m3fnuz (AMD gfx942) scheme that runs a stored e4m3fn FP8 scheme's data after an exact
    conversion (vLLM's normalize_e4m3fn_to_e4m3fnuz), or None for a non-FP8 scheme."""
    return f"{scheme}_fnuz" if scheme and scheme.startswith("fp8_") and not scheme.endswith("_fnuz") else None


def unquantized(dtype: str) -> StoredFormat:
    return StoredFormat(dtype, f"unquantized {dtype}", dtype)


def fp8_per_block(block: tuple[int, int], scale_fmt: str | None = None) -> StoredFormat:
    scales = f" ({scale_fmt} scales)" if scale_fmt else ""
    detail = f"FP8 e4m3 with {block[0]}x{block[1]} block scales{scales}"
    return StoredFormat("fp8_per_block", detail, "fp8_per_block", block, scale_fmt)


def fp8_per_tensor() -> StoredFormat:
    return StoredFormat("fp8_per_tensor", "FP8 e4m3 with one per-tensor scale", "fp8_per_tensor")


def fp8_per_channel() -> StoredFormat:
    detail = "FP8 e4m3 with one scale per output channel"
    return StoredFormat("fp8_per_channel", detail, "fp8_per_channel", scheme_uk="fp8_per_block")


def mxfp4(activations_fp4: bool) -> StoredFormat:
    if activations_fp4:
        return StoredFormat("mxfp4", "W4A4 MXFP4 (dynamic MXFP4 activations)", "mxfp4")
    return StoredFormat("mxfp4", "W4A16 MXFP4 (weight-only)", "mxfp4_w4a16")


def mxfp8() -> StoredFormat:
    return StoredFormat("mxfp8", "MXFP8 weights (e4m3, e8m0 scale per 32)", "mxfp8")


def unsupported(name: str, detail: str) -> StoredFormat:
    """A real format that no mlaq scheme runs exactly (NVFP4, int4, ...)."""
    return StoredFormat(name, detail, None)


def unknown(method: str) -> StoredFormat:
    return StoredFormat("unknown", f"unknown (quant_method {method!r})", None)
