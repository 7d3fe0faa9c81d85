"""Absorbed-MLA batched-matmul schemes: exact emulations of what each engine computes."""

from mlaq.bmm.base import BmmScheme, PreparedWeight
from mlaq.bmm.check import DEFAULT_SHAPES, KernelReport, KernelShape, ShapeCheck, check_kernel
from mlaq.bmm.fp8 import Fp8PerBlock, Fp8PerChannel, Fp8PerHead, Fp8PerTensor, Fp8Weight
from mlaq.bmm.kv_b import (
    split_kv_b_proj,
    split_kv_b_proj_fp8,
    split_kv_b_proj_fp8_scaled,
    split_kv_b_proj_mx_uv,
)
from mlaq.bmm.mx import Mxfp4, Mxfp4W4A16, Mxfp8, MxWeight
from mlaq.bmm.registry import get_scheme, scheme_names
from mlaq.bmm.sm90 import Bf16Sm90, Fp8PerBlockSm90

__all__ = [
    "DEFAULT_SHAPES",
    "Bf16Sm90",
    "BmmScheme",
    "Fp8PerBlock",
    "Fp8PerBlockSm90",
    "Fp8PerChannel",
    "Fp8PerHead",
    "Fp8PerTensor",
    "Fp8Weight",
    "KernelReport",
    "KernelShape",
    "MxWeight",
    "Mxfp4",
    "Mxfp4W4A16",
    "Mxfp8",
    "PreparedWeight",
    "ShapeCheck",
    "check_kernel",
    "get_scheme",
    "scheme_names",
    "split_kv_b_proj",
    "split_kv_b_proj_fp8",
    "split_kv_b_proj_fp8_scaled",
    "split_kv_b_proj_mx_uv",
]
