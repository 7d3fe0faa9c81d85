"""What mlaq may replace when it writes a report directory (``--out``) or a recording (``--record``):
only what it wrote itself. Anything else is the user's, and replacing it needs ``--overwrite``.

mlaq recognises its own files by their content: a report directory holds a manifest
(``.mlaq-outputs.json``) with the SHA-256 of each file mlaq wrote there, and a file still matching its
hash is mlaq's (a report the user edited since is theirs). A recording is recognised by its own header
(``mlaq.validate.server.record``). The directory is checked (and created) before anything is
measured, so a bad ``--out`` costs nothing.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> _ = (d / "report.json").write_text("{}")    # the user's file, not mlaq's
>>> prepare_out(d, ["report.json"])  # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: --out ...report.json exists and was not written by mlaq; move it away, pick another --out, or pass --overwrite
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

MANIFEST = ".mlaq-outputs.json"
_MAGIC = "mlaq-outputs"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(out: Path) -> dict[str, str]:
    """name -> SHA-256 of what mlaq last wrote there ({} when there is no readable manifest)."""
    try:
        doc = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = doc.get("files") if isinstance(doc, dict) and doc.get("magic") == _MAGIC else None
    return {k: v for k, v in files.items() if isinstance(v, str)} if isinstance(files, dict) else {}


def written_by_mlaq(out: Path, name: str) -> bool:
    """True when ``out/name`` is exactly what mlaq last wrote there."""
    path = out / name
    expected = _manifest(out).get(name)
    try:
        return expected is not None and path.is_file() and not path.is_symlink() and _sha256(path) == expected
    except OSError:
        return False


def check_replaceable(out: Path, names: Iterable[str], overwrite: bool = False, flag: str = "--out") -> None:
    """ValueError naming the first of ``names`` in ``out`` that mlaq did not write (unless ``overwrite``)."""
    for name in names:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            raise ValueError(f"{flag} {path} is a directory where mlaq writes a file; move it away")
        if overwrite or not (path.exists() or path.is_symlink()) or written_by_mlaq(out, name):
            continue
        raise ValueError(
            f"{flag} {path} exists and was not written by mlaq; move it away, pick another {flag}, "
            "or pass --overwrite"
        )


def prepare_out(out: str | Path, names: Iterable[str], overwrite: bool = False, flag: str = "--out") -> Path:
    """Check (and create) a report directory before anything is measured: ValueError naming ``flag``
    when it is a file, cannot be created or written, or holds one of ``names`` mlaq did not write."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".mlaq-probe-", dir=out))  # writable: a report can land
        probe.rmdir()
    except OSError as exc:
        raise ValueError(f"{flag} {out}: cannot write there ({exc.strerror or exc})") from None
    check_replaceable(out, names, overwrite, flag)
    return out


def note_written(out: Path, names: Iterable[str]) -> None:
    """Add ``names`` (just written into ``out``) to its manifest, atomically."""
    files = _manifest(out)
    files.update({name: _sha256(out / name) for name in names})
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"magic": _MAGIC, "files": files}, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, out / MANIFEST)
