"""mlaq's one safetensors byte-range reader: a file's header, then exactly the bytes asked for.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header (name -> dtype, shape,
``data_offsets`` relative to the end of the header) + the data. :class:`RangeReader` reads the 8-byte
length and the header of a file once, then each requested tensor (or rows of it) with ``os.pread`` of
exactly its byte ranges: nothing else of the file is read, and every byte read is counted, so
``mlaq audit`` can show (and its benchmark check against ``/proc/self/io``) that a 700 GB checkpoint
cost it only its kv_b_proj bytes, and ``validate --stream`` holds only the tensors it keeps. No memory
map: a mapped file's read-ahead would pull in neighbours and grow the resident set. A file is opened
for each read, never kept open: a shard gone mid-run is reported as missing, not read from a stale handle.
Both checkpoint views read through it: ``range_checkpoint.RangeCheckpoint`` (every shard, the stream)
and ``mlaq.audit.source.RangeCheckpoint`` (only the shards the index names for kv_b_proj); the
memory-mapped ``checkpoint.SafetensorsCheckpoint`` takes its tensor map from :func:`checkpoint_spans`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from torch import Tensor

# safetensors dtype strings -> torch (mlaq's weight formats, their scales, the integer kinds)
DTYPES = MappingProxyType(
    {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F8_E8M0": torch.float8_e8m0fnu,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "U16": torch.uint16,
        "U32": torch.uint32,
        "U64": torch.uint64,
        "BOOL": torch.bool,
    }
)
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the header size


class ShardMissingError(FileNotFoundError):
    """A shard named by the checkpoint cannot be read any more."""


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor lies: absolute byte range [start, end) of ``file``."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Header:
    file: Path
    size: int  # bytes of the file on disk
    nbytes: int  # 8 + the JSON header's length
    tensors: MappingProxyType[str, TensorSpan]


class RangeReader:
    """Reads safetensors headers and single tensors by exact byte ranges, counting every byte.

    >>> reader = RangeReader()                                     # doctest: +SKIP
    >>> t = reader.tensor(reader.header(path).tensors["w"])       # doctest: +SKIP
    >>> reader.bytes_read                                          # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.bytes_read = 0
        self.header_bytes = 0
        self.tensor_bytes = 0
        self.seconds_reading = 0.0  # wall time inside tensor reads (open + pread): the I/O share of a run
        self._headers: dict[Path, Header] = {}
        self._lock = threading.RLock()  # audit reads layers from several threads; header() re-enters pread()

    def pread(self, file: Path, offset: int, length: int) -> bytearray:
        """``length`` bytes of ``file`` from ``offset`` (fewer at its end): the one place file bytes are read
        (tests replace it to forbid ranges). One copy, from the kernel into the buffer returned."""
        data = bytearray(length)
        view, got = memoryview(data), 0
        with open(file, "rb", buffering=0) as f:
            while got < length:  # a read returns at most ~2 GiB
                n = os.preadv(f.fileno(), [view[got:]], offset + got)
                if n == 0:
                    break
                got += n
        view.release()
        del data[got:]
        with self._lock:
            self.bytes_read += got
        return data

    def header(self, file: Path) -> Header:
        """The parsed header of ``file`` (read once)."""
        with self._lock:
            if file not in self._headers:
                self._headers[file] = self._read_header(file)
            return self._headers[file]

    def _read_header(self, file: Path) -> Header:
        try:
            size = file.stat().st_size
        except OSError as exc:
            raise FileNotFoundError(f"{file}: cannot open ({exc.strerror})") from None
        head = self.pread(file, 0, 8)
        if len(head) < 8:
            raise ValueError(
                f"{file}: not a safetensors file ({size} bytes, shorter than its 8-byte header length)"
            )
        n = int.from_bytes(head, "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(
                f"{file}: not a safetensors file or truncated (header length {n}, file {size} bytes)"
            )
        raw = self.pread(file, 8, n)
        self.header_bytes += 8 + n  # under the lock held by header()
        try:
            entries = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{file}: corrupt safetensors header ({exc})") from None
        if not isinstance(entries, dict):
            raise ValueError(f"{file}: corrupt safetensors header (not a JSON object)")
        spans = {
            name: _span(file, name, entry, 8 + n) for name, entry in entries.items() if name != "__metadata__"
        }
        return Header(file, size, 8 + n, MappingProxyType(spans))

    def tensor(self, span: TensorSpan) -> Tensor:
        """The tensor at ``span``, read with one pread of exactly its bytes."""
        size = self.header(span.file).size
        if span.end > size:
            raise ValueError(
                f"{span.file.name}: tensor {span.name!r} needs bytes {span.start}..{span.end} but the file has "
                f"only {size} bytes: the shard is truncated (re-download it)"
            )
        data = self.pread(span.file, span.start, span.nbytes) if span.nbytes else bytearray()
        if len(data) != span.nbytes:
            raise ValueError(f"{span.file.name}: tensor {span.name!r}: short read; the shard is truncated")
        with self._lock:
            self.tensor_bytes += span.nbytes
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return flat.view(DTYPES[span.dtype]).reshape(span.shape)

    def ranges(self, span: TensorSpan, ranges: Sequence[tuple[int, int]]) -> Tensor:
        """The bytes of ``ranges`` ((offset in the tensor, length) each) of ``span``'s tensor, concatenated,
        as uint8 in a fresh buffer; the shard is opened for this read only."""
        start = time.perf_counter()
        buf = torch.empty(sum(n for _, n in ranges), dtype=torch.uint8)  # not zero-filled: read over
        _read_into(buf, span, ranges)
        with self._lock:
            self.bytes_read += buf.numel()
            self.tensor_bytes += buf.numel()
            self.seconds_reading += time.perf_counter() - start
        return buf


def checkpoint_spans(reader: RangeReader, files: Sequence[Path]) -> dict[str, TensorSpan]:
    """Every tensor of a checkpoint's ``files``: name -> span, each header parsed and checked once. A
    header that is not safetensors, a tensor past its file's end, a name stored in two files: one error
    naming the file (and the tensor)."""
    spans: dict[str, TensorSpan] = {}
    for file in files:
        try:
            header = reader.header(file)
        except ValueError as exc:
            reason = str(exc).removeprefix(f"{file}: ")
            raise ValueError(f"{file}: corrupt or truncated safetensors file ({reason})") from None
        for name, span in header.tensors.items():
            if span.end > header.size:
                raise ValueError(
                    f"{file}: corrupt or truncated safetensors file (tensor {name!r} out of range)"
                )
            if name in spans:
                raise ValueError(f"tensor {name!r} is stored twice: in {spans[name].file} and {file}")
            spans[name] = span
    return spans


def _read_into(buf: Tensor, span: TensorSpan, ranges: Sequence[tuple[int, int]]) -> None:
    """pread each (offset in the tensor, length) of ``ranges`` into ``buf``, one after the other."""
    try:
        fd = os.open(span.file, os.O_RDONLY)
    except FileNotFoundError:
        raise ShardMissingError(
            f"shard {span.file} (holding tensor {span.name!r}) is missing: it was there when the run "
            "started; restore it and run again"
        ) from None
    except OSError as exc:
        raise ValueError(f"{span.file}: cannot open to read tensor {span.name!r} ({exc})") from None
    try:
        view, at = memoryview(buf.numpy()), 0
        for offset, length in ranges:
            done = 0
            while done < length:  # pread may return short counts on large reads
                n = os.preadv(fd, [view[at + done : at + length]], span.start + offset + done)
                if n <= 0:
                    raise ValueError(
                        f"{span.file}: truncated while reading tensor {span.name!r}; the shard changed "
                        "during the run"
                    )
                done += n
            at += length
    finally:
        os.close(fd)


def _span(file: Path, name: str, entry: object, base: int) -> TensorSpan:
    where = f"{file.name}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise ValueError(f"{where}: corrupt header entry {entry!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise ValueError(f"{where}: stored dtype {dtype} is not one mlaq reads ({', '.join(DTYPES)})")
    ok = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    if not ok or not 0 <= offsets[0] <= offsets[1]:
        raise ValueError(f"{where}: corrupt header entry {entry!r}")
    count = 1
    for d in shape:
        count *= d
    if (offsets[1] - offsets[0]) != count * DTYPES[dtype].itemsize:
        raise ValueError(f"{where}: header says {dtype} {shape} but gives {offsets[1] - offsets[0]} bytes")
    return TensorSpan(file, name, dtype, tuple(shape), base + offsets[0], base + offsets[1])
