"""Lazy, memory-mapped reading of a Hugging Face safetensors checkpoint.

A checkpoint directory holds ``model.safetensors`` or ``model.safetensors.index.json`` plus shards.
The tensor map (names, files, shapes) comes from mlaq's one safetensors header parser
(``range_reader.checkpoint_spans``: the same checks and errors as the byte-range views). The tensors
themselves are read through ``safe_open``, memory-mapped, on purpose: the in-memory engine keeps a
weight whose dtype already matches as the mapped tensor itself (``loader._set`` makes no copy), so its
pages stay file-backed: the kernel can drop and re-read them under memory pressure, and processes
loading the same checkpoint (``mlaq serve`` beside ``mlaq validate``) share them in the page cache. A
``pread`` into a private buffer (the range reader) would turn every weight into anonymous memory and
add one copy per tensor at load. The byte-range views exist for the opposite need: reading a few
tensors (audit), or a checkpoint larger than memory layer by layer (validate --stream), where a map's
touched pages would pile up in the resident set. Every error names the file and, where there is one,
the tensor.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from mlaq.model.loading.range_reader import RangeReader, TensorSpan, checkpoint_spans

SINGLE_FILE = "model.safetensors"
TEXT_PREFIXES = ("language_model.",)  # multimodal checkpoints that nest the text model (Kimi-K2.5)
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
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
        self._spans: dict[str, TensorSpan] = {}
        self._where: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # name mlaq reads -> name in the file

    def _resolve_files(self) -> list[Path]:
        return check_weight_files(self.directory)

    def __enter__(self) -> SafetensorsCheckpoint:
        self._spans = checkpoint_spans(RangeReader(), self._files)  # headers: read and checked once
        self._where = {name: span.file for name, span in self._spans.items()}
        try:
            for file in self._files:
                try:
                    self._handles[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
                except (SafetensorError, OSError) as exc:
                    raise ValueError(f"{file}: corrupt or truncated safetensors file ({exc})") from exc
        except BaseException:
            self._stack.close()
            raise
        self._stored = {name: name for name in self._where}
        self._strip_text_prefix()
        return self

    def _strip_text_prefix(self) -> None:
        """Kimi-K2.5 (``model_type: kimi_k25``) stores its text model as ``language_model.model.layers.N.*``
        and ``language_model.lm_head.weight`` beside a vision tower (its model.safetensors.index.json):
        read those under the names of the text model (``model.layers.N.*``, ``lm_head.weight``)."""
        for prefix in TEXT_PREFIXES:
            if (
                not self.has("model.embed_tokens.weight")
                and f"{prefix}model.embed_tokens.weight" in self._where
            ):
                inner = {n[len(prefix) :]: n for n in self._where if n.startswith(prefix)}
                self._stored = {**{n: n for n in self._where}, **inner}
                self._where = {**self._where, **{n: self._where[s] for n, s in inner.items()}}
                return

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
        return name in self._where or self._stacked(name) is not None

    def _stacked(self, name: str) -> tuple[str, int, slice | None] | None:
        """transformers 5 saves routed experts stacked: ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows
        first) and ``mlp.experts.down_proj`` [E, H, I]. A per-expert name -> (stacked name, expert, rows)."""
        m = _PER_EXPERT.match(name)
        if m is None or name in self._where:
            return None
        base, e, proj = m.group(1), int(m.group(2)), m.group(3)
        stacked = f"{base}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        if stacked not in self._where:
            return None
        if proj == "down_proj":
            return stacked, e, None
        half = self.shape(stacked)[1] // 2
        return stacked, e, slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)

    def file_of(self, name: str) -> Path:
        stacked = self._stacked(name)
        if stacked is not None:
            return self._where[stacked[0]]
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint in {self.directory}")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if self._stacked(name) is not None:
            return tuple(self.get(name).shape)
        self.file_of(name)  # a clear error when it is missing
        return self._spans[self._stored.get(name, name)].shape

    def get(self, name: str) -> Tensor:
        """Read one tensor (memory-mapped; a copy is made only by later conversions)."""
        file = self.file_of(name)
        stacked = self._stacked(name)
        stored = stacked[0] if stacked is not None else name
        try:
            handle = self._handles[file]
            if stacked is None:
                return handle.get_tensor(self._stored.get(name, name))
            _, e, rows = stacked
            full = handle.get_slice(self._stored.get(stored, stored))
            return full[e] if rows is None else full[e, rows.start : rows.stop]
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


def check_weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (an index's shards, or model.safetensors), checked
    to exist; a directory of PyTorch pickles (pytorch_model.bin) is refused by name, never opened."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{index}: not a safetensors index (needs a 'weight_map' object): {exc}"
            ) from exc
        files = sorted({directory / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
    if pickles:
        raise FileNotFoundError(
            f"{directory} holds {', '.join(pickles[:2])} but no {SINGLE_FILE} or {INDEX_FILE}: mlaq reads "
            "safetensors only and never unpickles PyTorch files; convert the checkpoint to safetensors first"
        )
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}; mlaq reads safetensors checkpoints only"
    )
