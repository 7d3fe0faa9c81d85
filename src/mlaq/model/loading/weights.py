"""Linear weights as checkpoints store them, and their exact dequantization.

On-disk formats (per linear module ``m``; detected from the tensors present, cross-checked against
the checkpoint's ``quantization_config.quant_method``):

| format       | tensors                                                           | quant_method        |
|--------------|-------------------------------------------------------------------|---------------------|
| DENSE        | ``m.weight`` bf16/fp16/fp32                                         | any                 |
| FP8_BLOCK    | ``m.weight`` e4m3fn + ``m.weight_scale_inv`` fp32 [ceil(out/b0), ceil(in/b1)] | fp8 (DeepSeek/GLM) |
|              | (compressed-tensors: the same grid stored as ``m.weight_scale``)   | compressed-tensors  |
| FP8_PER_TENSOR | ``m.weight`` e4m3fn + ``m.weight_scale`` fp32/bf16 [] / [1]                  | compressed-tensors, quark |
| FP8_PER_CHANNEL | ``m.weight`` e4m3fn + ``m.weight_scale`` fp32/bf16 [out, 1] / [out] (per output row) | compressed-tensors, quark |
| MXFP4        | ``m.weight`` uint8 fp4x2 [out, in/2] + ``m.weight_scale`` uint8 E8M0 [out, ceil(in/32)] | quark |

Activation scales (``input_scale``) are not read: mlaq dequantizes these weights to the compute dtype
and emulates quantized arithmetic only in the absorbed MLA matmuls (kv_b_proj, via the policy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from mlaq.formats import Fp8Tensor, MxTensor
from mlaq.model.loading.checkpoint import SafetensorsCheckpoint, check_finite

DENSE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class WeightFormat(Enum):
    DENSE = "dense"
    FP8_BLOCK = "fp8_block"
    FP8_PER_TENSOR = "fp8_per_tensor"
    FP8_PER_CHANNEL = "fp8_per_channel"
    MXFP4 = "mxfp4"


# Which on-disk formats each quant_method may use (None: no quantization_config).
_ALLOWED: dict[str | None, frozenset[WeightFormat]] = {
    None: frozenset({WeightFormat.DENSE}),
    "fp8": frozenset({WeightFormat.DENSE, WeightFormat.FP8_BLOCK}),
    "compressed-tensors": frozenset(
        {
            WeightFormat.DENSE,
            WeightFormat.FP8_PER_TENSOR,
            WeightFormat.FP8_PER_CHANNEL,
            WeightFormat.FP8_BLOCK,
        }
    ),
    "quark": frozenset(
        {WeightFormat.DENSE, WeightFormat.FP8_PER_TENSOR, WeightFormat.FP8_PER_CHANNEL, WeightFormat.MXFP4}
    ),
}


@dataclass(frozen=True)
class CheckpointQuant:
    """What the loader needs from ``quantization_config``: the method and the FP8 block size."""

    method: str | None
    block: tuple[int, int] = (128, 128)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> CheckpointQuant:
        qc = hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config")
        if not qc:
            return cls(None)
        method = qc.get("quant_method")
        if method not in _ALLOWED:
            known = ", ".join(repr(m) for m in _ALLOWED if m)
            raise ValueError(
                f"{source}: quantization_config.quant_method {method!r} cannot be loaded; mlaq loads {known}"
            )
        if method == "fp8" and qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"{source}: fp8 checkpoint fmt {qc.get('fmt')!r} is not supported (only 'e4m3')")
        if method == "quark":
            _refuse_quark_fp4_inputs(qc, source)
        block = qc.get("weight_block_size") or _ct_block(qc) or (128, 128)
        return cls(method, (int(block[0]), int(block[1])))


def _refuse_quark_fp4_inputs(qc: Mapping[str, Any], source: str) -> None:
    """A Quark spec with dynamic MXFP4 ``input_tensors`` (W4A4) asks every such linear to quantize its
    activations at run time; mlaq runs checkpoint linears weights-only, which moved logits 0.8-1.0
    (relative) away from Quark's own simulation. Refuse rather than run something else."""
    specs = [("global_quant_config", qc.get("global_quant_config"))]
    for key in ("layer_type_quant_config", "layer_quant_config"):
        specs += [(f"{key}[{k!r}]", v) for k, v in (qc.get(key) or {}).items()]
    for where, spec in specs:
        inputs = (spec or {}).get("input_tensors") if isinstance(spec, Mapping) else None
        weight = (spec or {}).get("weight") if isinstance(spec, Mapping) else None
        if isinstance(inputs, Mapping) and inputs.get("dtype") in ("fp4", "mxfp4") and weight:
            raise ValueError(
                f"{source}: quantization_config.{where} quantizes input_tensors dynamically to MXFP4 (W4A4); mlaq "
                "runs checkpoint linears weights-only and does not emulate quantized linear activations, so it "
                "refuses to load it (`mlaq explain` still reads it; a W4A16 export, input_tensors null, loads)"
            )


def _ct_block(qc: Mapping[str, Any]) -> list[int] | None:
    """compressed-tensors: the first config group's weights.block_structure, if any."""
    for group in (qc.get("config_groups") or {}).values():
        block = (group.get("weights") or {}).get("block_structure")
        if block:
            return block
    return None


@dataclass(frozen=True)
class CheckpointWeight:
    """One linear weight as stored: ``codes`` plus the scale its format needs (None for DENSE)."""

    name: str  # module name, e.g. model.layers.0.self_attn.kv_b_proj
    format: WeightFormat
    codes: Tensor
    scale: Tensor | None = None
    block: tuple[int, int] | None = None  # FP8_BLOCK only

    def fp8(self) -> Fp8Tensor:
        """An FP8 weight as an Fp8Tensor, codes and scales exactly as stored: FP8_BLOCK with its block,
        FP8_PER_TENSOR as block (None, None) (scale [1, 1]), FP8_PER_CHANNEL as (1, None) (scale [out, 1])."""
        if self.format is WeightFormat.FP8_BLOCK:
            return Fp8Tensor.from_checkpoint(self.codes, self.scale, self.block)
        if self.scale is None or self.format not in _FP8_SCALED_BLOCK:
            raise ValueError(f"{self.name}: weight is {self.format.value}, not FP8")
        block = _FP8_SCALED_BLOCK[self.format]
        grid = (1, 1) if block[0] is None else (self.codes.shape[0], 1)
        return Fp8Tensor.from_checkpoint(self.codes, self.scale.reshape(grid), block)

    def dequantize(self) -> Tensor:
        """The weight's exact value, fp32 (DENSE bf16/fp16 -> fp32 is exact too)."""
        if self.format is WeightFormat.DENSE:
            return self.codes.float()
        if self.format is WeightFormat.MXFP4:
            return MxTensor.from_packed(self.codes, self.scale, axis=-1).dequantize()
        return self.fp8().dequantize()


# The Fp8Tensor block spec of the scaled FP8 formats (None = the whole dim)
_FP8_SCALED_BLOCK: dict[WeightFormat, tuple[int | None, int | None]] = {
    WeightFormat.FP8_PER_TENSOR: (None, None),
    WeightFormat.FP8_PER_CHANNEL: (1, None),
}


def read_linear(
    ckpt: SafetensorsCheckpoint, quant: CheckpointQuant, module: str, shape: tuple[int, int]
) -> CheckpointWeight:
    """Read linear ``module``'s weight (out, in) in whatever format the checkpoint stores it."""
    wname = f"{module}.weight"
    codes = ckpt.get(wname)
    out, k = shape
    where = ckpt.where(wname)
    if ckpt.has(f"{module}.weight_scale_inv"):
        fmt, scale = WeightFormat.FP8_BLOCK, ckpt.get(f"{module}.weight_scale_inv")
        block: tuple[int, int] | None = quant.block
        _expect(codes, (out, k), (torch.float8_e4m3fn,), where)
        _expect(
            scale, _grid(shape, quant.block), (torch.float32, torch.bfloat16), where + " weight_scale_inv"
        )
    elif ckpt.has(f"{module}.weight_scale"):
        scale = ckpt.get(f"{module}.weight_scale")
        block = None
        if codes.dtype == torch.uint8:
            fmt = WeightFormat.MXFP4
            _expect(codes, (out, math.ceil(k / 2)), (torch.uint8,), where + " (packed fp4x2)")
            _expect(
                scale, (out, math.ceil(k / 32)), (torch.uint8, torch.float8_e8m0fnu), where + " weight_scale"
            )
        else:
            _expect(codes, (out, k), (torch.float8_e4m3fn,), where)
            grid = _grid(shape, quant.block)
            if scale.dim() == 2 and tuple(scale.shape) == grid and grid[0] != out:
                fmt, block = WeightFormat.FP8_BLOCK, quant.block  # compressed-tensors block strategy
            elif scale.numel() == 1:
                fmt = WeightFormat.FP8_PER_TENSOR
            elif tuple(scale.shape) in ((out,), (out, 1)):
                fmt = WeightFormat.FP8_PER_CHANNEL
            else:
                raise ValueError(
                    f"{where} weight_scale: shape {tuple(scale.shape)} is neither per-tensor ([] or [1]), "
                    f"per-channel ([{out}] or [{out}, 1]) nor {quant.block} blocks {list(grid)}"
                )
            _expect(scale, tuple(scale.shape), (torch.float32, torch.bfloat16), where + " weight_scale")
    else:
        fmt, scale, block = WeightFormat.DENSE, None, None
        _expect(codes, (out, k), DENSE_DTYPES, where + " (no weight_scale_inv / weight_scale beside it)")
    if fmt not in _ALLOWED[quant.method]:
        raise ValueError(
            f"{where}: stored as {fmt.value}, which quantization_config quant_method "
            f"{quant.method!r} does not produce; the config and the weights disagree"
        )
    if scale is not None:
        check_finite(scale.float(), f"{where} scale")
    return CheckpointWeight(module, fmt, codes, scale, block)


def read_tensor(ckpt: SafetensorsCheckpoint, name: str, shape: tuple[int, ...]) -> Tensor:
    """A plain (unquantized) tensor: norm weights, embeddings, biases, router weights."""
    t = ckpt.get(name)
    _expect(t, shape, DENSE_DTYPES, ckpt.where(name))
    check_finite(t, ckpt.where(name))
    return t


def _grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def _expect(t: Tensor, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], where: str) -> None:
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{where}: dtype {str(t.dtype).removeprefix('torch.')} is not allowed here ({allowed})"
        )
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}: unexpected shape {tuple(t.shape)}, expected {tuple(shape)}")
