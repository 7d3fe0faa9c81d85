"""Where the compiled kernel lives: a directory only its user can write, so nobody else can plant a library.

A shared library runs code in the process that loads it (its constructors run at load). mlaq builds its
kernel into ``$XDG_CACHE_HOME/mlaq/kernels`` (default ``~/.cache/mlaq/kernels``), as torch's extension
builder uses a per-user cache, and loads from there only what passes these checks:

- the kernels directory and ``mlaq/`` above it: real directories (not symlinks), owned by the user,
  writable by nobody else (created 0700 when missing);
- every directory above those: owned by the user or root, and not writable by others unless sticky
  (as /tmp is: there, others cannot rename or delete what the user made);
- the library: a regular file (not a symlink), owned by the user, writable by nobody else. It is built
  under a fresh temporary name in that directory and renamed into place, whole or not at all.

Anything else is :class:`UnsafeKernelCache`, one line naming the path and what is wrong with it; mlaq
never falls back silently to another directory (the user should know someone could write there).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeKernelCache(ValueError):
    """The kernel cache (or a library in it) could be written by someone else: not loaded."""


def _who(st: os.stat_result) -> str:
    return f"owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"


def check_ancestors(path: Path) -> None:
    """Every directory above ``path`` (resolved): owned by the user or root, and not writable by
    group or others unless sticky."""
    me = os.geteuid()
    for parent in Path(os.path.realpath(path)).parents:
        st = parent.stat()
        if st.st_uid not in (me, 0):
            raise UnsafeKernelCache(
                f"kernel cache {path}: {parent} above it belongs to another user ({_who(st)}); "
                "set XDG_CACHE_HOME to a directory of your own"
            )
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafeKernelCache(
                f"kernel cache {path}: {parent} above it is writable by others and not sticky ({_who(st)}): "
                "they could replace the cache; set XDG_CACHE_HOME to a private directory"
            )


def check_private(path: Path, kind: str = "directory") -> None:
    """``path`` is a real ``kind`` (not a symlink), owned by the user, writable by nobody else."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeKernelCache(f"kernel cache: {path} is a symbolic link; remove it (mlaq makes its own)")
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        raise UnsafeKernelCache(f"kernel cache: {path} is not a {kind}; remove it")
    if st.st_uid != os.geteuid():
        raise UnsafeKernelCache(
            f"kernel cache: {path} belongs to another user ({_who(st)}); remove it (mlaq will rebuild)"
        )
    if st.st_mode & 0o022:
        raise UnsafeKernelCache(
            f"kernel cache: {path} is writable by others ({_who(st)}); remove it (mlaq will rebuild)"
        )


def prepare_cache(folder: Path) -> Path:
    """Create ``folder`` and its ``mlaq`` parent (0700) where missing, then check the whole chain."""
    own = [folder.parent, folder]  # .../mlaq and .../mlaq/kernels: mlaq's, and private
    try:
        folder.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the cache home
    except OSError as exc:
        raise UnsafeKernelCache(f"kernel cache: cannot create {folder.parent.parent} ({exc})") from None
    check_ancestors(folder.parent)
    for d in own:
        try:
            d.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UnsafeKernelCache(f"kernel cache: cannot create {d} ({exc.strerror or exc})") from None
        check_private(d)
    return folder


def check_library(path: Path) -> None:
    """A built library about to be loaded: a regular file of the user's that nobody else can write."""
    check_private(path, "file")
