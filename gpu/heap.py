"""The CPU process heap's policy after the weights are loaded: glibc told to keep freed memory for reuse."""

from __future__ import annotations

import ctypes
import ctypes.util


def keep_freed_memory() -> bool:
    """Hand back what loading the weights freed (malloc_trim), then make glibc keep freed memory for reuse.

    Each forward allocates and frees multi-megabyte temporaries; with glibc's defaults these are
    mmap'ed or trimmed on free, and every reuse pays page faults that cost up to 10x the arithmetic
    (rms_norm over 1024 tokens). The price is a process that keeps its peak heap: set before the load, that
    peak held the plain weights the pre-packed copies replaced. A no-op where glibc's mallopt is missing.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    getattr(libc, "malloc_trim", lambda _pad: 0)(0)
    m_trim_threshold, m_mmap_threshold = -1, -3
    ok = mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts
    return bool(ok and mallopt(m_trim_threshold, 1 << 30))
