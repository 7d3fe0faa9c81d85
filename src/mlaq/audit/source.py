"""A checkpoint directory seen through its index: tensor name -> shard, tensors read by exact byte range.

:class:`RangeCheckpoint` answers the ``has`` / ``get`` / ``where`` questions the loader's
``mlaq.model.loading.weights.read_linear`` asks, so the audit decodes kv_b_proj and its scales with the loader's
own format detection and checks, but reads a shard only when one of its tensors is asked for, and then
only that shard's header and that tensor's bytes. Shards that hold no kv_b_proj need not even exist.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from mlaq.model.loading.checkpoint import INDEX_FILE, SINGLE_FILE
from mlaq.model.loading.range_reader import RangeReader, TensorSpan


class RangeCheckpoint:
    """Tensor name -> shard file map of a checkpoint directory, read through a :class:`RangeReader`."""

    def __init__(self, directory: str | Path, reader: RangeReader | None = None) -> None:
        self.directory = Path(directory)
        self.reader = reader if reader is not None else RangeReader()
        self.weight_map = self._weight_map()
        self.spans_read: dict[str, TensorSpan] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                obj: Any = json.loads(index.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{index}: not valid JSON ({exc})") from None
            weight_map = obj.get("weight_map") if isinstance(obj, Mapping) else None
            if not isinstance(weight_map, Mapping) or not all(
                isinstance(v, str) for v in weight_map.values()
            ):
                raise ValueError(
                    f"{index}: not a safetensors index (needs a 'weight_map' of name -> shard file)"
                )
            return dict(weight_map)
        single = self.directory / SINGLE_FILE
        if single.is_file():
            return dict.fromkeys(self.reader.header(single).tensors, SINGLE_FILE)
        raise FileNotFoundError(
            f"{self.directory}: not a safetensors checkpoint (no {SINGLE_FILE} or {INDEX_FILE}); "
            "mlaq audit reads Hugging Face safetensors checkpoints"
        )

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def where(self, name: str) -> str:
        """'file: tensor' for error messages."""
        return f"{self.weight_map[name]}: tensor {name!r}" if name in self.weight_map else repr(name)

    def span(self, name: str) -> TensorSpan:
        """Where ``name`` lies, from its shard's header (read once per shard)."""
        if name not in self.weight_map:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        file = self.directory / self.weight_map[name]
        if not file.is_file():
            raise FileNotFoundError(
                f"{file.name}: shard missing from {self.directory} (the index puts tensor {name!r} in it); "
                "download it"
            )
        try:
            header = self.reader.header(file)
        except ValueError as exc:
            raise ValueError(f"{exc} (reading tensor {name!r})") from None
        found = header.tensors.get(name)
        if found is None:
            raise ValueError(
                f"{file.name}: the index puts tensor {name!r} in this shard, but the shard has no such tensor; "
                "the index and the shards disagree (re-download the checkpoint)"
            )
        return found

    def get(self, name: str) -> Tensor:
        """Read one tensor: exactly its bytes."""
        span = self.span(name)
        tensor = self.reader.tensor(span)
        self.spans_read[name] = span
        return tensor
