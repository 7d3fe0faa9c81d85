"""A checkpoint directory read by byte range: each tensor with ``os.pread`` into its own buffer.

:class:`SafetensorsCheckpoint` memory-maps whole shards; every page a read touches then stays in the
process's resident set until the shard is closed, so streaming a checkpoint larger than RAM through it
would grow RSS with every layer. This view parses each shard's header once and reads a tensor's exact
byte range on demand, through mlaq's one range reader (:class:`~mlaq.model.loading.range_reader.RangeReader`):
memory holds only the tensors the caller keeps, and ``bytes_read`` counts the tensor bytes read so far.
Same verbs as SafetensorsCheckpoint (``has``, ``get``, ``shape``, ``where``), so the loader's weight
readers (weights.py) take either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mlaq.model.loading.checkpoint import check_weight_files
from mlaq.model.loading.range_reader import (
    DTYPES,
    RangeReader,
    ShardMissingError,
    checkpoint_spans,
)

__all__ = ["RangeCheckpoint", "ShardMissingError", "TensorInfo"]


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
        self.reader = RangeReader()
        # the same file discovery, header checks and errors as the memory-mapped reader
        self._spans = checkpoint_spans(self.reader, check_weight_files(self.directory))
        self._info = {
            n: TensorInfo(s.file, DTYPES[s.dtype], s.shape, s.start, s.nbytes) for n, s in self._spans.items()
        }

    def __enter__(self) -> RangeCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far (headers not counted)."""
        return self.reader.tensor_bytes

    @property
    def seconds_reading(self) -> float:
        """Wall time inside tensor reads (open + pread): the I/O share of a run."""
        return self.reader.seconds_reading

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
        return self.reader.ranges(self._spans[name], ranges)
