"""Lazy, memory-mapped reading of a Hugging Face safetensors checkpoint.

A checkpoint directory holds ``model.safetensors`` or ``model.safetensors.index.json`` plus shards.
Tensors are read one at a time through ``safe_open`` (memory-mapped): the whole checkpoint is never
in memory. Every error names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """Tensor name -> file map of a checkpoint directory; open it with ``with``.

    >>> with SafetensorsCheckpoint("ckpt/") as ckpt:      # doctest: +SKIP
    ...     w = ckpt.get("model.embed_tokens.weight")
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._files = self._resolve_files()
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}

    def _resolve_files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}"
                ) from exc
            files = sorted({self.directory / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
            return files
        single = self.directory / SINGLE_FILE
        if single.is_file():
            return [single]
        raise FileNotFoundError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {self.directory}; mlaq reads safetensors checkpoints only"
        )

    def __enter__(self) -> SafetensorsCheckpoint:
        try:
            for file in self._files:
                try:
                    handle = self._stack.enter_context(safe_open(str(file), framework="pt"))
                except (SafetensorError, OSError) as exc:
                    raise ValueError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc
                self._handles[file] = handle
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if name in self._where:
                        raise ValueError(
                            f"tensor {name!r} is stored twice: in {self._where[name]} and {file}"
                        )
                    self._where[name] = file
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def keys(self) -> list[str]:
        return list(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.file_of(name)].get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        """Read one tensor (memory-mapped; a copy is made only by later conversions)."""
        file = self.file_of(name)
        try:
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ValueError(f"{file}: cannot read tensor {name!r} ({exc})") from exc

    def where(self, name: str) -> str:
        """'file: tensor' for error messages."""
        return f"{self.file_of(name).name}: tensor {name!r}" if name in self._where else repr(name)


def check_finite(t: Tensor, what: str) -> None:
    """Reject NaN/inf in a weight: they would silently poison every output (formats.md, MX NaN rule)."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{what} holds {bad} non-finite value(s) (NaN/inf); the checkpoint is corrupt")
