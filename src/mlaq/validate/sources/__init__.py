"""Measurement sources: each one measures the variants of a validation and returns one ``Record``.

A source is anything with ``measure(progress) -> Record`` (see ``Source``): the in-memory engine
(``engine.EngineSource``), the checkpoint streamed layer by layer (``stream.StreamSource``) and live
servers (``server.ServerSource``) fill the same record; ``mlaq.validate.runner.run`` measures any of
them, and statistics and every report read only the record.
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
