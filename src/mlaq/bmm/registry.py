"""Scheme names -> scheme objects. Names follow vLLM's online-quantization shorthands.

FP8 schemes use e4m3fn (NVIDIA, AMD gfx950); the suffix ``_fnuz`` names the same scheme over
e4m3fnuz (AMD gfx942 / MI300), e.g. ``fp8_per_tensor_fnuz``; the suffix ``_sm90`` names the same scheme
with NVIDIA Hopper's tensor-core sums (``bf16_sm90``, ``fp8_per_block_sm90``, measured on an H200); the
suffix ``_sglang`` names SGLang 0.5.23's own arithmetic (``mlaq.bmm.sglang_fp8``).
"""

from __future__ import annotations

from collections.abc import Callable

from mlaq.bmm.base import Bf16Reference, BmmScheme, Fp32Reference
from mlaq.bmm.fp8 import Fp8PerBlock, Fp8PerChannel, Fp8PerHead, Fp8PerTensor
from mlaq.bmm.mx import Mxfp4, Mxfp4W4A16, Mxfp8
from mlaq.bmm.sglang_fp8 import Fp8PerTensorBatchSglang, Fp8PerTensorSglang, Fp8PerTensorW8A16Sglang
from mlaq.bmm.sm90 import Bf16Sm90, Fp8PerBlockSm90
from mlaq.formats import Fp8Dtype

_FP8 = (Fp8PerTensor, Fp8PerHead, Fp8PerChannel, Fp8PerBlock)


def _factories() -> dict[str, Callable[[], BmmScheme]]:
    table: dict[str, Callable[[], BmmScheme]] = {
        "fp32": Fp32Reference,
        "bf16": Bf16Reference,
        "bf16_sm90": Bf16Sm90,
    }
    for cls in _FP8:
        table[cls.base_name] = cls
    table["fp8_per_block_sm90"] = Fp8PerBlockSm90
    table.update({"mxfp4": Mxfp4, "mxfp4_w4a16": Mxfp4W4A16, "mxfp8": Mxfp8})
    for cls in _FP8:
        table[f"{cls.base_name}_fnuz"] = lambda cls=cls: cls(Fp8Dtype.E4M3FNUZ)
    # SGLang 0.5.23's arithmetic (mlaq.bmm.sglang_fp8); bmm_fp8's batch scheme exists on CUDA only
    for cls in (Fp8PerTensorSglang, Fp8PerTensorW8A16Sglang):
        table[cls.base_name] = cls
        table[f"{cls.base_name}_fnuz"] = lambda cls=cls: cls(Fp8Dtype.E4M3FNUZ)
    table[Fp8PerTensorBatchSglang.base_name] = Fp8PerTensorBatchSglang
    return table


def scheme_names() -> tuple[str, ...]:
    """Every registered name: references (with bf16's Hopper variant), fp8 (e4m3fn, with fp8_per_block's
    Hopper variant), MX, the e4m3fnuz variants, then SGLang's FP8 schemes."""
    return tuple(_factories())


def get_scheme(name: str) -> BmmScheme:
    """The scheme called ``name``; an unknown name is an error listing the known ones."""
    factory = _factories().get(name)
    if factory is None:
        raise ValueError(f"unknown BMM scheme {name!r}; known schemes: {', '.join(scheme_names())}")
    return factory()
