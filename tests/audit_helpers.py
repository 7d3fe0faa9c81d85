"""Checkpoints for the audit tests, in the real on-disk layouts (transformers' names, shards + index).

``bf16_checkpoint``: a random DeepSeek-V3 saved by transformers (real geometry P=128/R=64/V=128, small
hidden size), with an MTP layer, converted to bf16 and sharded in 2 files with an index.
``header_spans``: every tensor's absolute byte range, parsed here independently of mlaq.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from model_helpers import add_mtp_layer, edit_config, hf_checkpoint, read_tensors, write_tensors


def bf16_checkpoint(path: Path) -> Path:
    model, _ = hf_checkpoint("deepseek_v3", path, seed=3)
    add_mtp_layer(model, path)
    tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in read_tensors(path).items()}
    write_tensors(path, tensors, shards=2)
    edit_config(path, torch_dtype="bfloat16")
    return path


def header_spans(path: Path) -> dict[str, tuple[Path, int, int]]:
    """tensor name -> (file, start, end) of every tensor in every .safetensors file of ``path``."""
    out: dict[str, tuple[Path, int, int]] = {}
    for file in sorted(path.glob("*.safetensors")):
        raw = file.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        for name, entry in header.items():
            if name != "__metadata__":
                a, b = entry["data_offsets"]
                out[name] = (file, 8 + n + a, 8 + n + b)
    return out


def header_ranges(path: Path) -> set[tuple[Path, int, int]]:
    """(file, start, end) of the length field and of the JSON header of every shard."""
    out = set()
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        out |= {(file, 0, 8), (file, 8, 8 + n)}
    return out
