"""Byte-range reading of a safetensors checkpoint: each tensor read with ``os.pread`` into its own buffer.

:class:`SafetensorsCheckpoint` memory-maps whole shards; every page a read touches then stays in the
process's resident set until the shard is closed, so streaming a checkpoint larger than RAM through it
would grow RSS with every layer. This reader parses each shard's header once (8-byte little-endian
length, JSON header: ``{name: {dtype, shape, data_offsets}}``, then the data) and reads a tensor's exact
byte range on demand: memory holds only the tensors the caller keeps, and ``bytes_read`` counts the
checkpoint bytes read so far. Same verbs as SafetensorsCheckpoint (``has``, ``get``, ``shape``, ``where``),
so the loader's weight readers (weights.py) take either.

A shard is opened for each read, never kept open: a shard that disappears mid-run (a network mount
gone, a file deleted) is reported as missing, naming the tensor, rather than read from a stale handle.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor

from mlaq.model.loading.checkpoint import SafetensorsCheckpoint

# safetensors dtype codes -> torch (the ones mlaq's weight formats use, plus the integer kinds)
DTYPES = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": torch.float8_e8m0fnu,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }
)
_MAX_HEADER = 100 * 2**20  # the safetensors format's own limit on the JSON header


class ShardMissingError(FileNotFoundError):
    """A shard named by the checkpoint cannot be read any more."""


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class RangeCheckpoint:
    """Tensor name -> (shard, byte range) of a checkpoint directory; ``with`` for symmetry with
    SafetensorsCheckpoint (nothing stays open between reads)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        # the same file discovery and errors as the memory-mapped reader (index, single file)
        files = SafetensorsCheckpoint(self.directory)._files
        self._info: dict[str, TensorInfo] = {}
        for file in files:
            for name, info in _read_header(file).items():
                if name in self._info:
                    raise ValueError(
                        f"tensor {name!r} is stored twice: in {self._info[name].file} and {file}"
                    )
                self._info[name] = info
        self.bytes_read = 0
        self.seconds_reading = 0.0  # wall time inside reads (open + pread): the I/O share of a run

    def __enter__(self) -> RangeCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def keys(self) -> list[str]:
        return list(self._info)

    def has(self, name: str) -> bool:
        return name in self._info

    def info(self, name: str) -> TensorInfo:
        if name not in self._info:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return self._info[name]

    def file_of(self, name: str) -> Path:
        return self.info(name).file

    def shape(self, name: str) -> tuple[int, ...]:
        return self.info(name).shape

    def nbytes(self, name: str) -> int:
        return self.info(name).nbytes

    def where(self, name: str) -> str:
        return f"{self._info[name].file.name}: tensor {name!r}" if name in self._info else repr(name)

    def get(self, name: str) -> Tensor:
        """Read one tensor's bytes into a new CPU tensor (nothing else of the shard is read)."""
        info = self.info(name)
        buf = self._read(name, info, [(0, info.nbytes)])
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=info.dtype)
        return buf.view(info.dtype).reshape(info.shape)

    def get_rows(self, name: str, rows: Sequence[int]) -> Tensor:
        """Rows ``rows`` (ascending, distinct) of a 2-D tensor, e.g. the embedding rows of a batch's
        tokens: (len(rows), cols), reading only those rows' bytes."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise ValueError(f"{self.where(name)}: expected a 2-D tensor, got shape {info.shape}")
        n_rows, cols = info.shape
        if rows and not (rows[0] >= 0 and rows[-1] < n_rows):
            raise ValueError(f"{self.where(name)}: row ids must lie in 0..{n_rows - 1}")
        row_bytes = info.nbytes // n_rows if n_rows else 0
        runs: list[tuple[int, int]] = []  # (first row, count) of consecutive rows: one read each
        for r in rows:
            if runs and runs[-1][0] + runs[-1][1] == r:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((r, 1))
        buf = self._read(name, info, [(r * row_bytes, n * row_bytes) for r, n in runs])
        if not rows:
            return torch.empty(0, cols, dtype=info.dtype)
        return buf.view(info.dtype).reshape(len(rows), cols)

    def _read(self, name: str, info: TensorInfo, ranges: Sequence[tuple[int, int]]) -> Tensor:
        """The bytes of ``ranges`` ((offset in the tensor, length) each), concatenated, as uint8."""
        start = time.perf_counter()
        buf = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)  # not zero-filled: read over
        try:
            fd = os.open(info.file, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardMissingError(
                f"shard {info.file} (holding tensor {name!r}) is missing: it was there when the run "
                "started; restore it and run again"
            ) from None
        except OSError as exc:
            raise ValueError(f"{info.file}: cannot open to read tensor {name!r} ({exc})") from None
        try:
            view, at = memoryview(buf.numpy()), 0
            for offset, length in ranges:
                done = 0
                while done < length:  # pread may return short counts on large reads
                    n = os.preadv(fd, [view[at + done : at + length]], info.start + offset + done)
                    if n <= 0:
                        raise ValueError(
                            f"{info.file}: truncated while reading tensor {name!r}; "
                            "the shard changed during the run"
                        )
                    done += n
                at += length
        finally:
            os.close(fd)
        self.bytes_read += buf.numel()
        self.seconds_reading += time.perf_counter() - start
        return buf


def _read_header(file: Path) -> dict[str, TensorInfo]:
    """Parse one shard's header; a clear error for anything that is not a safetensors file."""
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{file}: corrupt or truncated safetensors file (no header)")
            (size,) = struct.unpack("<Q", head)
            if size > _MAX_HEADER:
                raise ValueError(f"{file}: corrupt or truncated safetensors file (header of {size} bytes)")
            raw = f.read(size)
        total = file.stat().st_size
    except OSError as exc:
        raise ValueError(f"{file}: cannot read ({exc})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: corrupt or truncated safetensors file (bad header: {exc})") from None
    base = 8 + size
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise ValueError(
                f"{file}: tensor {name!r} has dtype {meta.get('dtype')!r}, which mlaq cannot read"
            )
        shape = tuple(int(d) for d in meta["shape"])
        begin, end = (int(x) for x in meta["data_offsets"])
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if end - begin != nbytes or base + end > total:
            raise ValueError(f"{file}: corrupt or truncated safetensors file (tensor {name!r} out of range)")
        out[name] = TensorInfo(file, dtype, shape, base + begin, nbytes)
    return out
