"""Measurement sources: each one measures the variants of a validation and returns one ``Record``.

A source is anything with ``measure(progress) -> Record`` (see ``Source``). Today there is one, the
in-memory engine (``engine.EngineSource``); a live server, a layer-streamed checkpoint or a task suite
is one more module here that fills the same record — statistics and every report read only the record.
"""

from __future__ import annotations

from typing import Protocol

from mlaq.validate.progress import Progress
from mlaq.validate.record import Record


class Source(Protocol):
    name: str

    def measure(self, progress: Progress) -> Record:
        """Run every measurement; progress steps go to ``progress``."""
        ...
