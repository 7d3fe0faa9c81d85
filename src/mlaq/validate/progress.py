"""Progress while a validation runs: :mod:`mlaq.progress` under the label ``validate``."""

from __future__ import annotations

from mlaq.progress import NullProgress, PlainProgress, Progress, RichProgress
from mlaq.progress import make_progress as _make_progress

__all__ = ["NullProgress", "PlainProgress", "Progress", "RichProgress", "make_progress"]


def make_progress(enabled: bool = True) -> Progress:
    """Rich if importable, else plain lines; silent when not ``enabled``."""
    return _make_progress("validate", enabled)
