"""mlaq.libc: glibc's allocator policies. Each runs in a fresh interpreter (a policy is process-wide)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import SRC

PROBE = """
import resource, sys, torch
from mlaq import libc
policy = sys.argv[1]
ok = getattr(libc, policy)() if policy != "none" else True
torch.set_num_threads(1)
faults = []
for _ in range(10):  # a 64 MB fp32 temporary and its doubled copy, freed each time (as a window's scores)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    big = torch.empty(4, 2048, 2048).fill_(1.0)
    twice = big * 2
    del big, twice
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(ok, sum(faults[-4:]))  # steady state: the last four iterations
"""


def _faults(policy: str) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
    ).stdout.split()  # fmt: skip
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_keep_freed_memory_reuses_pages_without_faulting():
    """Default glibc maps each 64 MB tensor anew (above its 32 MiB mmap ceiling) and faults in its 16,384
    pages every time; after keep_freed_memory the freed heap pages are reused once the heap has grown."""
    ok, kept = _faults("keep_freed_memory")
    _, default = _faults("none")
    assert ok
    assert default > 4 * 2 * 16000 and kept <= default / 8, (default, kept)  # 0 or one tensor seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_return_freed_memory_maps_big_blocks_and_trimmer_exists():
    from mlaq.libc import heap_trimmer

    ok, faults = _faults("return_freed_memory")
    assert ok and faults > 4 * 2 * 16000  # every 64 MB block mapped anew: returned to the OS when freed
    assert heap_trimmer() is not None
