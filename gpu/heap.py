"""The CPU process heap's policy: glibc told to keep freed memory for reuse, and what loading freed handed back."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse: allocations of up to 32 MiB from its arenas instead of mmap, no
    trimming below 1 GiB free, and a 64 MiB top pad, which keeps a thread arena's emptied heaps (glibc deletes a
    secondary heap once the previous one has that pad free, whatever the trim threshold). Set before the engine's
    threads start (engine_setup.prepare).

    Each forward allocates and frees multi-megabyte temporaries; with glibc's defaults these are mmap'ed, trimmed or
    their heaps deleted on free, and every reuse pays page faults that cost up to 10x the arithmetic (rms_norm over
    1024 tokens; 5-10 us a fault on a VM). 24 fresh prompts of 48 ids, 40 tokens, LoRA disabled, the bench model,
    fp32, 2 threads, an AVX2 EPYC: 26,000-40,000 page faults a batch and 2.4-2.9 s with the thresholds alone, set at
    the end of the load; 45-2,055 faults after the first batch, and 2.2-2.7 s, with this. tests/gpu/test_heap_policy.py
    counts them. A no-op where glibc's mallopt is missing (False)."""
    libc = _libc()
    if libc is None:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = libc.mallopt(m_mmap_threshold, 32 << 20)  # the largest value glibc accepts
    ok = ok and libc.mallopt(m_trim_threshold, 1 << 30)
    return bool(ok and libc.mallopt(m_top_pad, 64 << 20))


def hand_back_freed_memory() -> None:
    """Hand back what loading the weights freed (malloc_trim), after the last allocation of the load: the heap kept
    the plain weights the pre-packed copies replaced, and the file's pages it read through. A no-op without glibc."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
