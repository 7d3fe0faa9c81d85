"""The process's memory: glibc malloc's reuse of freed blocks, and the resident set.

glibc's malloc serves blocks above its mmap threshold (128 KiB, raised dynamically to at most 32 MiB)
with fresh ``mmap`` pages and unmaps them on ``free``, and trims the heap's free top above 128 KiB.
Torch's CPU tensors are plain malloc blocks, so a run that allocates and frees the same
multi-megabyte score, probability and float64 emulation tensors thousands of times (``mlaq
validate``) faults every page of each one in again and has the kernel zero it: measured on one
core of an AMD EPYC (Zen 3), one window of validate's teacher-forced stage took 62.9 s CPU, 16.7 s
of it system time and 7 M minor page faults, and 42.9 s (1.3 s system) with freed memory kept.
Nothing is computed differently: only where the bytes come from.

``retain_freed_memory`` raises the mmap threshold to 1 GiB (blocks below it come from the heap and
are reused after ``free``) and the trim threshold to 2 GiB (at most that much free memory is kept at
the heap's top). A process-wide setting: the command-line entry points call it, the library does not.
A streamed validation wants the opposite, memory back as soon as it is freed (``return_freed_memory``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks below 1 GiB come from the heap (glibc accepts up to HEAP_MAX/2)
TRIM_THRESHOLD = (1 << 31) - 1  # free heap top kept up to 2 GiB (an int parameter)
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's own default (what a streamed run restores)


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where it fails or the C library is not glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.mallopt
    except (OSError, AttributeError):  # musl and other C libraries have no mallopt
        return False
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(fn(param, value))


def retain_freed_memory() -> bool:
    """Set glibc's malloc to keep freed blocks for reuse; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


RETURN_THRESHOLD = 2**20  # return_freed_memory: blocks from 1 MiB up are mapped alone, unmapped when freed


def return_freed_memory() -> bool:
    """Make glibc's malloc give every freed buffer of ``RETURN_THRESHOLD`` bytes or more back to the OS.

    By default glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB):
    after the first layer's weights are released, buffers of up to 32 MiB come from the heap instead,
    where freed ones stay resident (fragmentation), and the resident set of a streamed run creeps a
    layer's worth above what it holds. A fixed threshold turns the adjustment off. Called once per
    streamed run (not at import); a no-op (False) where the C library is not glibc. The heap's trim
    threshold goes back to glibc's default, in case an in-memory run in this process raised it
    (``retain_freed_memory``)."""
    return mallopt(M_MMAP_THRESHOLD, RETURN_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)


def current_rss() -> int:
    """The process's resident set now, bytes (Linux /proc; the peak as a fallback elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss()


def peak_rss() -> int:
    """The process's peak resident set so far, bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
