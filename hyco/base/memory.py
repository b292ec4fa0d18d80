"""Memory: this process's peak and present RSS and CPU seconds, for the stages' reports, and the
glibc heap settings of the stages that allocate and free GB-sized transients (freed memory that
stays in the heap still counts in RSS)."""

from __future__ import annotations

import contextlib
import gc
import os
import resource
import sys
from pathlib import Path


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


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MiB.

    Reads VmHWM, the high-water mark of this process's own address space. Not ru_maxrss: Linux
    carries that across fork and exec, and Python's subprocess starts children with vfork, so a
    child of a big pytest process reports the parent's peak before it has done anything. VmHWM is
    max(the kernel's high-water mark, the RSS now), and the kernel updates its mark lazily, so a
    later read can be lower than an earlier one (by a fraction of a MiB between phases):
    the highest figure read so far is returned.
    """
    global _highest_rss_mb
    peak = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024  # kB
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # no procfs: KiB, but bytes on macOS
        peak = peak / 2**20 if sys.platform == "darwin" else peak / 1024
    if _highest_rss_mb[0] != os.getpid():  # a forked child starts its own count
        _highest_rss_mb = (os.getpid(), 0.0)
    _highest_rss_mb = (os.getpid(), max(_highest_rss_mb[1], peak))
    return _highest_rss_mb[1]


_highest_rss_mb = (os.getpid(), 0.0)


def note_child_peak(child_mb: float, parent_mb: float = 0.0) -> None:
    """Worker processes this one waited for peaked at `child_mb` together: from now on
    `peak_rss_mb` is at least that plus this process's RSS while they ran, taken as the larger of
    `parent_mb` (its RSS when they started) and its RSS now (an upper bound of the sum)."""
    global _highest_rss_mb
    peak_rss_mb()  # start this process's own count first
    _highest_rss_mb = (os.getpid(), max(_highest_rss_mb[1], max(parent_mb, rss_mb()) + child_mb))


def rss_mb() -> float:
    """Resident memory of this process now, in MiB (what a phase leaves behind for the next)."""
    with contextlib.suppress(OSError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return 0.0


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
