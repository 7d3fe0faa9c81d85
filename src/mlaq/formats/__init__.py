"""Number formats: FP8 (e4m3fn, e4m3fnuz, e5m2) with every scaling granularity, and OCP MX.

Every quantizer here is an exact emulation of a named engine's arithmetic; each module's
docstring names the engine and the conventions chosen.
"""

from mlaq.formats.e2m1 import e2m1_decode, e2m1_encode, e2m1_round, pack_e2m1, unpack_e2m1
from mlaq.formats.fp8 import (
    Fp8Dtype,
    Fp8Tensor,
    e4m3fn_to_e4m3fnuz,
    fp8_cast,
    quantize_fp8,
    quantize_fp8_per_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token_group,
)
from mlaq.formats.mx import MxTensor, mx_fake_quant, quantize_mx
from mlaq.formats.scale_rules import MxElem, ScaleRule, e8m0_decode, e8m0_scale_exponent

__all__ = [
    "Fp8Dtype",
    "Fp8Tensor",
    "MxElem",
    "MxTensor",
    "ScaleRule",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round",
    "e4m3fn_to_e4m3fnuz",
    "e8m0_decode",
    "e8m0_scale_exponent",
    "fp8_cast",
    "mx_fake_quant",
    "pack_e2m1",
    "quantize_fp8",
    "quantize_fp8_per_block",
    "quantize_fp8_per_channel",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_token_group",
    "quantize_mx",
    "unpack_e2m1",
]
