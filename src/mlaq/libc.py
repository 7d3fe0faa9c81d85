"""glibc's allocator knobs through ctypes: the one place mlaq calls the C library (no-ops elsewhere).

PyTorch allocates CPU tensors with malloc. glibc serves blocks above its mmap threshold (dynamic, at most
32 MiB) with a fresh mapping each time and unmaps them when freed, so a loop that makes and frees tensors
of tens of MB (a 2,048-token window's attention scores, a batch's gathered cache) pays the kernel's page
faults on every iteration — more than the arithmetic on a CPU that computes the rest in fp32 GEMMs. Three
policies, each chosen by the command that owns the process (never at import):
- :func:`keep_freed_memory` (in-memory ``mlaq validate``, ``mlaq generate``, ``mlaq serve``; a program
  that embeds ``mlaq.LLM`` may call it too): blocks below 1 GiB from the heap, up to 2 GiB of freed pages
  kept at its top, so freed pages are reused without faults; the resident set stays near its peak.
  Batch-32 decode at 512-token contexts: ~330 -> ~115 ms CPU per step (bench/RESULTS.md).
- :func:`return_freed_memory` (``--stream``): a fixed 1 MiB threshold, so every freed buffer of that size
  goes back to the OS and a streamed run's resident set follows what it holds.
- :func:`heap_trimmer` (``mlaq serve``): ``malloc_trim``, called when the engine goes idle (returns the
  kept pages then).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 2**20  # return_freed_memory: allocations from 1 MiB up get their own mapping
# keep_freed_memory: blocks below 1 GiB from the heap (glibc accepts up to HEAP_MAX/2), and the heap's top
# trimmed only above 2 GiB free
KEEP_MMAP_THRESHOLD = 2**30
KEEP_TRIM_THRESHOLD = 2**31 - 1
DEFAULT_TRIM_THRESHOLD = 128 * 1024  # glibc's own (what return_freed_memory puts back)


def _libc_function(name: str) -> Callable | None:
    """``name`` from the C library when it is glibc's (has it), else None."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt(param, value)``; False where it is missing or refuses."""
    fn = _libc_function("mallopt")
    if fn is None:
        return False
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(fn(param, value))


def keep_freed_memory() -> bool:
    """Serve blocks below 1 GiB from the heap (no per-block mappings) and keep up to 2 GiB of freed pages at
    its top for reuse."""
    return mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)


def return_freed_memory() -> bool:
    """Give every freed buffer of ``MMAP_THRESHOLD`` bytes or more back to the OS.

    By default glibc raises its mmap threshold to the size of each mapped block freed (up to 32 MiB):
    after the first layer's weights are released, buffers of up to 32 MiB come from the heap instead,
    where freed ones stay resident (fragmentation), and the resident set of a streamed run creeps a
    layer's worth above what it holds. A fixed threshold turns the adjustment off. The trim threshold
    goes back to glibc's default, in case an in-memory run in this process kept freed memory (tests,
    notebooks)."""
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)


def heap_trimmer() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None on another libc). Each serving step frees tensors of shapes that
    change with the batch and its context lengths; glibc keeps the freed pages of its arenas (and,
    once a large block was freed, serves even large tensors from them), so a serving process's RSS
    creeps up over many steps. Trimming when the engine goes idle returns those pages to the OS."""
    return _libc_function("malloc_trim")
