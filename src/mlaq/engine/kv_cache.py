"""Per-layer storage of MLA's latent cache, [c_kv | k_pe] (L + R values a token), in paged slots.

MLA caches one latent vector per token instead of per-head keys and values: c_kv (kv_lora_rank L,
after the kv_a RMSNorm) and the shared rope key k_pe (qk_rope_head_dim R, after RoPE). The
absorbed decode path reads them back gathered per batch, (B, S_max, L + R), with lengths.

``kv_cache_dtype``:
- ``auto``: the model dtype, exact.
- ``fp8_e4m3`` (alias ``fp8``): float8_e4m3fn with ONE per-tensor scale, default 1.0 as vLLM
  (``k_scale``/``v_scale`` = 1.0 unless a checkpoint provides them; MLA has one latent tensor so one
  scale). Stored value = fp8(clamp(x / scale, ±448)), read back as fp8 * scale. The clamp makes
  saturation explicit (torch < 2.13 turned overflow into NaN). The error: e4m3 keeps 3 mantissa
  bits, so normal values (|x / scale| >= 2^-6) get a relative rounding error of at most 2^-4
  (6.25 %), about 2.7 % RMS on Gaussian-like latents; values below 2^-6 fall into the subnormal
  range with an absolute step of 2^-9 * scale; |x| > 448 * scale saturates. RMSNorm'd c_kv is O(1)
  and k_pe O(1..10), so scale 1.0 keeps them in the normal range (tests pin these figures).

DeepSeek Sparse Attention layers also cache their indexer key (index_head_dim D values a token).
Those ``extra_dims`` columns ride along after [c_kv | k_pe] in writes and reads but are stored in
the model dtype whatever ``kv_cache_dtype`` says (mlaq does not emulate vLLM's fp8 indexer cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor

from mlaq.engine.block_manager import BatchSlots

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn


class KVCacheDtype(Enum):
    """The cache storage choices, spelled as vLLM's ``--kv-cache-dtype``."""

    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"

    @classmethod
    def parse(cls, value: str | KVCacheDtype) -> KVCacheDtype:
        if isinstance(value, KVCacheDtype):
            return value
        aliases = {"fp8": cls.FP8_E4M3}  # vLLM's "fp8" means e4m3 on this path
        try:
            return aliases.get(value) or cls(value)
        except ValueError:
            choices = [m.value for m in cls] + list(aliases)
            raise ValueError(f"unknown kv_cache_dtype {value!r}; choose one of {choices}") from None


@dataclass(frozen=True)
class LatentCacheConfig:
    """Geometry and storage of the latent cache of a whole model (MTP layers included)."""

    num_layers: int
    kv_lora_rank: int  # L
    qk_rope_head_dim: int  # R
    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16  # the model dtype; what "auto" stores and what reads return
    kv_cache_dtype: KVCacheDtype = KVCacheDtype.AUTO
    scale: float = 1.0  # fp8 per-tensor scale (vLLM's default 1.0)
    extra_dims: tuple[int, ...] = ()  # per layer (or empty): DSA indexer-key columns after L + R

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", KVCacheDtype.parse(self.kv_cache_dtype))
        object.__setattr__(self, "extra_dims", tuple(self.extra_dims) or (0,) * self.num_layers)
        if len(self.extra_dims) != self.num_layers or min(self.extra_dims) < 0:
            raise ValueError(
                f"extra_dims needs one value >= 0 per layer ({self.num_layers}), got {self.extra_dims}"
            )
        for name in ("num_layers", "kv_lora_rank", "qk_rope_head_dim", "num_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.scale > 0 or self.scale == float("inf"):
            raise ValueError(f"the kv cache scale must be a positive finite number, got {self.scale}")

    @property
    def entry_size(self) -> int:
        """L + R values per token and layer (the latent part)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def layer_width(self, layer: int) -> int:
        """Values a token per ``layer``: L + R, plus the layer's extra (indexer) columns."""
        return self.entry_size + self.extra_dims[layer]

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self.kv_cache_dtype is KVCacheDtype.FP8_E4M3 else self.dtype


def quantize_fp8_e4m3(x: Tensor, scale: float) -> Tensor:
    """x / scale, clamped to ±448 (saturate, as the kernels do), rounded to nearest-even e4m3fn."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8_e4m3(q: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    return (q.float() * scale).to(dtype)


class LatentKVCache:
    """Storage (num_layers, num_blocks * block_size, L + R) (+ indexer columns of DSA layers);
    slots come from ``BlockManager``."""

    def __init__(self, config: LatentCacheConfig) -> None:
        self.config = config
        c = config
        num_slots = c.num_blocks * c.block_size
        self.data = torch.zeros(c.num_layers, num_slots, c.entry_size, dtype=c.storage_dtype)
        self.extra = {
            layer: torch.zeros(num_slots, d, dtype=c.dtype) for layer, d in enumerate(c.extra_dims) if d
        }

    @property
    def nbytes(self) -> int:
        extra = sum(t.numel() * t.element_size() for t in self.extra.values())
        return self.data.numel() * self.data.element_size() + extra

    def write(self, layer: int, slots: Tensor | slice, entries: Tensor) -> None:
        """Store ``entries`` (T, L + R [+ extra]) = [c_kv | k_pe | index key] of T tokens at ``slots``
        (T,) (or a slice of T consecutive slots)."""
        c = self.config
        width = c.layer_width(layer)
        if entries.dim() != 2 or entries.shape[1] != width or entries.shape[0] != _count(slots):
            extra = f" + {c.extra_dims[layer]} indexer" if c.extra_dims[layer] else ""
            raise ValueError(
                f"cache write of shape {tuple(entries.shape)} at {_count(slots)} slots of layer {layer}; "
                f"expected (T, L + R = {c.kv_lora_rank} + {c.qk_rope_head_dim}{extra})"
            )
        latent = entries[:, : c.entry_size]
        if c.kv_cache_dtype is KVCacheDtype.FP8_E4M3:
            self.data[layer, slots] = quantize_fp8_e4m3(latent, c.scale)
        else:
            self.data[layer, slots] = latent.to(c.dtype)
        if c.extra_dims[layer]:
            self.extra[layer][slots] = entries[:, c.entry_size :].to(c.dtype)

    def read(self, layer: int, slots: Tensor) -> Tensor:
        """The stored entries at ``slots`` (any shape ...) -> (..., width) in the model dtype."""
        c = self.config
        stored = self.data[layer, slots]
        if c.kv_cache_dtype is KVCacheDtype.FP8_E4M3:
            stored = dequantize_fp8_e4m3(stored, c.scale, c.dtype)
        if c.extra_dims[layer]:
            stored = torch.cat([stored, self.extra[layer][slots]], dim=-1)
        return stored

    def gather(self, layer: int, batch: BatchSlots) -> tuple[Tensor, Tensor]:
        """(B, S_max, width) entries of a batch (zeros past each length) and the lengths (B,)."""
        latents = self.read(layer, batch.slots)  # (B, S_max, width)
        latents = latents.masked_fill(~batch.mask[..., None], 0)
        return latents, batch.lengths

    def gather_layers(self, num_layers: int, batch: BatchSlots) -> Sequence[Tensor]:
        """Layers 0..num_layers-1 at once: (num_layers, B, S_max, width), zeros past each length (one
        gather for all layers when none has indexer columns). May be a view of the storage: read it
        before the next write."""
        c = self.config
        if any(c.extra_dims[:num_layers]):
            return [self.gather(layer, batch)[0] for layer in range(num_layers)]
        if batch.first_slot is not None and c.kv_cache_dtype is KVCacheDtype.AUTO:
            # one sequence in consecutive slots: a view, no copy of its history (read-only use)
            s = batch.num_slots
            return self.data[:num_layers, None, batch.first_slot : batch.first_slot + s]  # (n, 1, S, L+R)
        stored = self.data[:num_layers, batch.slots]  # (n, B, S_max, L+R)
        if c.kv_cache_dtype is KVCacheDtype.FP8_E4M3:
            stored = dequantize_fp8_e4m3(stored, c.scale, c.dtype)
        return stored.masked_fill(~batch.mask[None, :, :, None], 0) if batch.padded else stored

    def write_layers(self, slots: Tensor | slice, entries: Sequence[Tensor] | Tensor) -> None:
        """Layer i of ``entries`` (T, width_i) at ``slots`` (T,) or a slice, for layers 0..len(entries)-1
        (``entries`` may be one (layers, T, width) tensor)."""
        c = self.config
        n = entries.shape[0] if isinstance(entries, Tensor) else len(entries)  # len(Tensor) is slow
        if any(c.extra_dims[:n]) or c.kv_cache_dtype is not KVCacheDtype.AUTO:
            for layer, entry in enumerate(entries):
                self.write(layer, slots, entry)
            return
        stacked = entries if isinstance(entries, Tensor) else torch.stack(tuple(entries))  # (n, T, L+R)
        if stacked.shape[1:] != (_count(slots), c.entry_size):
            raise ValueError(
                f"cache write of shape {tuple(stacked.shape)} at {_count(slots)} slots; "
                f"expected (layers, T, L + R = {c.entry_size})"
            )
        self.data[:n, slots] = stacked if stacked.dtype == c.dtype else stacked.to(c.dtype)

    def split(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """(..., L + R [+ extra]) -> c_kv (..., L), k_pe (..., R)."""
        lora, rope = self.config.kv_lora_rank, self.config.qk_rope_head_dim
        return latents[..., :lora], latents[..., lora : lora + rope]


def _count(slots: Tensor | slice) -> int:
    """How many slots a write index addresses (slices come from ``BlockManager.slot_index``)."""
    return slots.stop - slots.start if isinstance(slots, slice) else slots.shape[0]
