"""The compiled kernel is built into, and loaded from, a directory only its user can write
(``$XDG_CACHE_HOME/mlaq/kernels``): a planted library, a folder another user owns or can write, a
writable non-sticky parent or a symlink is one line, and nothing is loaded; ``compile=True`` stops
on it rather than falling back silently."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mlaq.model.kernels.kernel_cache import UnsafeKernelCache, check_ancestors, prepare_cache
from mlaq.model.kernels.mla_kernel import load_kernel
from mlaq.settings import kernel_cache_dir

OTHER_UID = 65534  # nobody
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")

EVIL = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); }
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A clean build in a private cache: the library's file name (its key) for planting tests."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    cache = tmp_path_factory.mktemp("home") / "cache" / "mlaq" / "kernels"
    return load_kernel(cache=cache).path


def _plant(path: Path, marker: Path, tmp: Path) -> None:
    """A library whose constructor writes ``marker`` when it is loaded, at ``path``."""
    src = tmp / "evil.c"
    src.write_text(EVIL)
    subprocess.run(["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(src), "-o", str(path)], check=True)


def test_the_cache_lives_under_xdg_cache_home():
    assert kernel_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/mlaq/kernels")
    assert kernel_cache_dir({"HOME": "/h"}) == Path("/h/.cache/mlaq/kernels")
    assert kernel_cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "rel"}) == Path("/h/.cache/mlaq/kernels")


@needs_cc
def test_a_clean_build_is_private_and_leaves_no_partial_file(built: Path):
    for d in (built.parent, built.parent.parent):
        assert d.stat().st_mode & 0o777 == 0o700 and d.stat().st_uid == os.geteuid()
    assert built.stat().st_mode & 0o022 == 0
    assert [p.name for p in built.parent.iterdir()] == [built.name]
    assert load_kernel(cache=built.parent).path == built  # built once, loaded again


@needs_cc
@needs_root
def test_a_library_planted_by_another_user_is_never_loaded(built: Path, tmp_path: Path):
    cache = tmp_path / "mlaq" / "kernels"
    prepare_cache(cache)
    marker = tmp_path / "constructor-ran"
    _plant(cache / built.name, marker, tmp_path)
    os.chown(cache / built.name, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeKernelCache, match="belongs to another user") as info:
        load_kernel(cache=cache)
    assert built.name in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()  # its constructor never ran


@needs_cc
@pytest.mark.parametrize("mode", [0o666, 0o646])
def test_a_library_others_can_write_is_not_loaded(built: Path, tmp_path: Path, mode):
    cache = prepare_cache(tmp_path / "mlaq" / "kernels")
    shutil.copy(built, cache / built.name)
    os.chmod(cache / built.name, mode)
    with pytest.raises(UnsafeKernelCache, match="writable by others"):
        load_kernel(cache=cache)


@needs_cc
def test_a_symlinked_library_is_not_loaded(built: Path, tmp_path: Path):
    cache = prepare_cache(tmp_path / "mlaq" / "kernels")
    (cache / built.name).symlink_to(built)
    with pytest.raises(UnsafeKernelCache, match="symbolic link"):
        load_kernel(cache=cache)


@needs_root
def test_a_kernels_folder_another_user_owns_is_refused(tmp_path: Path):
    cache = tmp_path / "mlaq" / "kernels"
    cache.mkdir(parents=True, mode=0o700)
    os.chmod(cache.parent, 0o700)
    os.chown(cache, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeKernelCache, match=r"kernels belongs to another user"):
        load_kernel(cache=cache)


@pytest.mark.parametrize("which", ["kernels", "mlaq"])
def test_a_folder_others_can_write_is_refused(tmp_path: Path, which):
    cache = tmp_path / "mlaq" / "kernels"
    cache.mkdir(parents=True, mode=0o700)
    os.chmod(cache.parent, 0o700)
    os.chmod(cache if which == "kernels" else cache.parent, 0o777)  # as an attacker pre-creating it would
    with pytest.raises(UnsafeKernelCache, match="writable by others"):
        load_kernel(cache=cache)


def test_a_symlinked_folder_is_refused(tmp_path: Path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "mlaq").mkdir(mode=0o700)
    (tmp_path / "mlaq" / "kernels").symlink_to(real)
    with pytest.raises(UnsafeKernelCache, match="symbolic link"):
        load_kernel(cache=tmp_path / "mlaq" / "kernels")


def test_a_writable_parent_must_be_sticky(tmp_path: Path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # anyone may rename what is in it
    with pytest.raises(UnsafeKernelCache, match="writable by others and not sticky"):
        prepare_cache(shared / "mlaq" / "kernels")
    os.chmod(shared, 0o1777)  # sticky, as /tmp: only the owner may rename its entries
    check_ancestors(shared / "mlaq")
    assert prepare_cache(shared / "mlaq" / "kernels").is_dir()


def test_compile_stops_on_an_unsafe_cache_instead_of_falling_back(monkeypatch):
    from mlaq.engine.compiled import _attention_kernel

    def unsafe(*args, **kwargs):
        raise UnsafeKernelCache("kernel cache: /x/mlaq/kernels is writable by others")

    monkeypatch.setattr("mlaq.engine.compiled.load_kernel", unsafe)
    with pytest.raises(UnsafeKernelCache, match="writable by others"):
        _attention_kernel("auto")
