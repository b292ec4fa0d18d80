"""glibc heap settings shared by the stages that allocate and free GB-sized transients (freed
memory that stays in the heap still counts in RSS)."""

from __future__ import annotations

import gc


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_large_blocks() -> None:
    """glibc: serve blocks >= 1 MiB by mmap (returned to the system when freed). Its default
    threshold grows up to 32 MiB as large blocks are freed, and freed activations, weights and
    sessions then stay in the heap, counted in RSS (bench/bench_convert.py measures it).
    Process-wide and harmless to later stages (more page faults)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def release_free_heap() -> None:
    """Hand the heap's free pages back (glibc malloc_trim) after a phase freed its transients."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
