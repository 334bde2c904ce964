"""Give freed heap memory back to the operating system after a start-up phase.

Start-up allocates and frees large tensors: the parameters a ``meta_init()`` build creates before moving them
to ``meta``, the values structure discovery makes for each module as the dry run touches it. glibc keeps freed
memory in its heap for reuse (its mmap threshold rises to the largest block freed, so later blocks of that
size come from the heap, not from ``mmap``), and the resident set of a rank stayed hundreds of MB above what it
holds (measured on a 1.2 GB GPT at pp=4: 340–420 MB after discovery, gone after a trim). ``malloc_trim(0)``
returns the free pages of every arena. Elsewhere (musl, macOS) there is nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable

__all__ = ["available_memory", "release_free_memory"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory(collect: bool = True) -> bool:
    """Collect garbage cycles (``collect``), then return the C heap's free pages to the system. Returns whether
    the C library could trim (glibc)."""
    if collect:
        gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def available_memory() -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes: what the host can give without swapping (0 where it cannot
    be read, so that a caller that sizes what it touches by it touches nothing)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
