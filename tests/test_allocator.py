"""mlaq.model.allocator: freed tensors are reused instead of faulted in again (glibc Linux only).

Run in subprocesses: the setting is process-wide and other tests set glibc's thresholds themselves."""

from __future__ import annotations

import subprocess
import sys

import pytest

CYCLES = 8
_PROBE = """
import resource, sys, torch
from mlaq.model.allocator import retain_freed_memory
ok = retain_freed_memory() if sys.argv[1] == "retain" else True
x = torch.ones(16 << 20)  # 64 MiB once, so that the first fault-in is not counted
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({cycles}):
    x = torch.ones(16 << 20)  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
    del x
print(int(ok), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(cycles=CYCLES), mode], capture_output=True, text=True, check=True
    )
    ok, faults = out.stdout.split()
    return ok == "1", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_retained_memory_is_not_faulted_in_again() -> None:
    pages = (64 << 20) // 4096
    ok, retained = _faults("retain")
    _, default = _faults("default")
    assert ok
    assert default >= (CYCLES - 1) * pages  # glibc's default: each 64 MiB block mapped and faulted anew
    assert retained <= 2 * pages  # kept: the blocks reused (measured: one block's pages in all)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_streamed_runs_setting_returns_memory_again_after_retaining() -> None:
    """return_freed_memory (a streamed run) after retain_freed_memory (an in-memory run, same process):
    freed blocks are unmapped again, so every 64 MiB block is faulted in anew."""
    probe = _PROBE.format(cycles=CYCLES).replace(
        "ok = retain_freed_memory() if",
        "from mlaq.model.allocator import return_freed_memory\nok = retain_freed_memory() and return_freed_memory() if",
    )
    out = subprocess.run([sys.executable, "-c", probe, "retain"], capture_output=True, text=True, check=True)
    ok, faults = out.stdout.split()
    assert ok == "1"
    assert int(faults) >= (CYCLES - 1) * (64 << 20) // 4096
