"""A checkpoint is a local directory: mlaq never downloads, and says so in one line (explain, generate,
validate, serve and audit all read the checkpoint through ``require_local_dir``)."""

from __future__ import annotations

import re
from pathlib import Path

# what a Hugging Face hub id looks like: owner/name, no leading dot or slash
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def require_local_dir(path: str | Path) -> Path:
    """``path`` as a directory; otherwise FileNotFoundError saying it is not a local directory and that
    mlaq does not download (with the ``hf download`` line to run when it looks like a hub id)."""
    p = Path(path)
    if p.is_dir():
        return p
    if p.exists():
        raise FileNotFoundError(f"{path}: not a directory; pass the checkpoint's directory")
    hint = f"hf download {path} --local-dir DIR" if _HUB_ID.match(str(path)) else "hf download"
    raise FileNotFoundError(
        f"{path}: not a local directory; mlaq does not download ({hint} first, then pass the directory)"
    )
