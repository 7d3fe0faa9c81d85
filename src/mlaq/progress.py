"""Progress over the steps of a long command, on stderr (stdout stays free for ``--json``).

One three-verb protocol for every front door (``mlaq validate``, ``mlaq audit``): ``begin(total)``,
``step(description)`` as each step starts, ``end(ok)``. ``rich`` draws a bar when it is importable (it
is not a core dependency); otherwise one plain line per step goes to stderr. ``NullProgress`` is silent
(tests, ``--no-progress``). Each bar or line starts with the command's label.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol


class Progress(Protocol):
    def begin(self, total: int) -> None: ...

    def step(self, description: str) -> None:
        """Starting a new step (the previous one is done)."""
        ...

    def end(self, ok: bool = True) -> None:
        """The run finished (``ok``) or failed."""
        ...

    def note(self, line: str) -> None:
        """One line for the user (e.g. "still waiting"), printed above the bar, never through it."""
        ...


class NullProgress:
    """No bar; a ``note`` still reaches stderr (a hung server must not look like a hung mlaq)."""

    def begin(self, total: int) -> None:
        pass

    def step(self, description: str) -> None:
        pass

    def end(self, ok: bool = True) -> None:
        pass

    def note(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)


class PlainProgress:
    """``audit [ 3/62] 12s  layer 2`` lines on stderr."""

    def __init__(self, label: str, stream: Any = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.done, self.start = 0, 0, time.perf_counter()

    def begin(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def step(self, description: str) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        width = len(str(self.total))
        line = f"{self.label} [{self.done:>{width}}/{self.total}] {elapsed:4.0f}s  {description}"
        print(line, file=self.stream)
        self.stream.flush()

    def note(self, line: str) -> None:
        print(line, file=self.stream, flush=True)

    def end(self, ok: bool = True) -> None:
        word = "done in" if ok else "failed after"
        print(f"{self.label}: {word} {time.perf_counter() - self.start:.0f}s", file=self.stream)


class RichProgress:
    """A rich progress bar on stderr."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        columns = (TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        self._bar = Bar(*columns, TextColumn("{task.description}"), console=Console(stderr=True))
        self._task: Any = None
        self._started = False

    def begin(self, total: int) -> None:
        self._bar.start()
        self._task = self._bar.add_task("", total=total)

    def step(self, description: str) -> None:
        if self._started:
            self._bar.advance(self._task)
        self._started = True
        self._bar.update(self._task, description=description)

    def note(self, line: str) -> None:
        self._bar.console.print(line, markup=False, highlight=False)  # above the live bar

    def end(self, ok: bool = True) -> None:
        if self._task is None:
            return
        if self._started and ok:
            self._bar.advance(self._task)
        self._bar.update(self._task, description="done" if ok else "failed")
        self._bar.stop()


def make_progress(label: str, enabled: bool = True) -> Progress:
    """Rich if importable, else plain lines; silent when not ``enabled``."""
    if not enabled:
        return NullProgress()
    try:
        return RichProgress(label)
    except ImportError:
        return PlainProgress(label)
