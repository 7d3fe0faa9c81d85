"""mlaq.libc: glibc's allocator policies (Linux only). Each probe runs in a fresh interpreter: a policy is
process-wide, and other tests set glibc's thresholds themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SRC

CYCLES = 8
PAGES = (64 << 20) // 4096  # one 64 MiB tensor: above glibc's largest dynamic mmap threshold (32 MiB)
PROBE = """
import resource, sys, torch
from mlaq import libc
ok = all(getattr(libc, name)() for name in sys.argv[1:])
for _ in range(6):  # warm up: the heap grows to its working size (faults there are not counted)
    x = torch.ones(16 << 20); y = x * 2; del x, y
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(CYCLES):  # steady state: two 64 MiB tensors made and freed per cycle
    x = torch.ones(16 << 20); y = x * 2; del x, y
print(int(ok), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""".replace("CYCLES", str(CYCLES))


def _faults(*policies: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *policies], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    ).stdout.split()  # fmt: skip
    return out[0] == "1", int(out[1])


pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def test_kept_memory_is_not_faulted_in_again() -> None:
    ok, kept = _faults("keep_freed_memory")
    _, default = _faults()
    assert ok
    assert default >= 2 * CYCLES * PAGES * 0.9  # glibc's default: each 64 MiB block mapped and faulted anew
    assert kept <= 2 * PAGES  # kept: the blocks reused (measured: 0, now and then one block's pages)


def test_a_streamed_runs_setting_returns_memory_again_after_keeping() -> None:
    """return_freed_memory (a streamed run) after keep_freed_memory (an in-memory run, same process):
    freed blocks are unmapped again, so every 64 MiB block is faulted in anew."""
    ok, faults = _faults("keep_freed_memory", "return_freed_memory")
    assert ok and faults >= 2 * CYCLES * PAGES * 0.9


def test_heap_trimmer_is_glibcs_malloc_trim() -> None:
    from mlaq.libc import heap_trimmer

    trim = heap_trimmer()
    assert trim is not None and trim(0) in (0, 1)
