"""Progress of a streamed validation on stderr: a bar over layers, the checkpoint bytes read, an ETA.

The ETA extrapolates from the bytes read so far against the bytes the plan will read (reading, and the
compute that follows each read, scale with a layer's size); rich draws it when importable, otherwise
one plain line per layer.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from mlaq.validate.stream.budget import peak_rss


class LayerProgress(Protocol):
    def begin(self, layers: int, total_bytes: int) -> None: ...

    def update(self, done_layers: int, bytes_read: int, description: str) -> None: ...

    def end(self, ok: bool) -> None: ...


class NullLayerProgress:
    def begin(self, layers: int, total_bytes: int) -> None:
        pass

    def update(self, done_layers: int, bytes_read: int, description: str) -> None:
        pass

    def end(self, ok: bool) -> None:
        pass


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


class PlainLayerProgress:
    """``validate --stream [ 3/62] 1.20 / 8.00 GB read, 42 s, ETA 240 s  layer 2: 9 experts`` lines."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.layers, self.total, self.start = 0, 0, time.perf_counter()

    def begin(self, layers: int, total_bytes: int) -> None:
        self.layers, self.total, self.start = layers, total_bytes, time.perf_counter()

    def update(self, done_layers: int, bytes_read: int, description: str) -> None:
        elapsed = time.perf_counter() - self.start
        eta = elapsed * (self.total - bytes_read) / bytes_read if bytes_read else float("nan")
        w = len(str(self.layers))
        print(
            f"validate --stream [{done_layers:>{w}}/{self.layers}] {_size(bytes_read)} / {_size(self.total)} "
            f"read, {elapsed:.0f} s, ETA {eta:.0f} s, peak RSS {peak_rss() / 2**30:.2f} GiB  {description}",
            file=self.stream,
            flush=True,
        )

    def end(self, ok: bool) -> None:
        word = "done in" if ok else "stopped after"
        print(f"validate --stream: {word} {time.perf_counter() - self.start:.0f}s", file=self.stream)


class RichLayerProgress:
    """A rich bar whose completed amount is the bytes read (so rich's ETA follows the reads)."""

    def __init__(self) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("[bold]validate --stream"),
            BarColumn(),
            TextColumn("layer {task.fields[layer]}"),
            DownloadColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=Console(stderr=True),
        )
        self._task: Any = None
        self._layers = 0

    def begin(self, layers: int, total_bytes: int) -> None:
        self._layers = layers
        self._bar.start()
        self._task = self._bar.add_task("", total=total_bytes, layer=f"0/{layers}")

    def update(self, done_layers: int, bytes_read: int, description: str) -> None:
        self._bar.update(
            self._task, completed=bytes_read, description=description, layer=f"{done_layers}/{self._layers}"
        )

    def end(self, ok: bool) -> None:
        if self._task is not None:
            self._bar.update(self._task, description="done" if ok else "stopped")
            self._bar.stop()


def make_layer_progress(enabled: bool = True) -> LayerProgress:
    if not enabled:
        return NullLayerProgress()
    try:
        return RichLayerProgress()
    except ImportError:
        return PlainLayerProgress()
