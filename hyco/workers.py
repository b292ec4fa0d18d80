"""Work in fresh worker processes (spawned, not forked: no inherited sessions or heap).

Two uses: memory that only leaves with its process (the QNN compiler keeps GBs after its session
is gone), and the second core of a 2-core box during single-threaded Python work (calibrate
prepares and quantizes the tree and prefill graphs side by side). Each worker gets the stage's
glibc heap setting and dies with its parent; its peak RSS comes back with its result and counts
in the parent's peak figure (`artifacts.note_child_peak`, the workers' peaks summed: they ran
together)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from hyco.errors import HycoError


def in_processes(fn: Callable[..., Any], jobs: Sequence[tuple], what: str) -> list[Any]:
    """[fn(*job) for job in jobs], each job in a process of its own, all at once. An exception
    raised in a worker is raised here as it was; a worker that dies (out of memory, killed)
    raises HycoError naming `what`."""
    from hyco.artifacts import note_child_peak

    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(len(jobs), mp_context=spawn, initializer=_worker_init) as pool:
        futures = [pool.submit(_measured, fn, job) for job in jobs]
        try:
            done = [f.result() for f in futures]
        except concurrent.futures.process.BrokenProcessPool:
            raise HycoError(f"{what}: a worker process died (out of memory?)") from None
    note_child_peak(sum(peak for _, peak in done))
    return [result for result, _ in done]


def _worker_init() -> None:
    """glibc's 1 MiB mmap threshold, as the stages' own processes have (the tree's compile in a
    process without it peaked at 6,446 MiB, 5,441 MiB with it), and death with the parent."""
    import ctypes
    import signal

    from hyco.heap import return_large_blocks

    return_large_blocks()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except OSError:
        pass  # no glibc: the worker outlives a killed parent until its job ends


def _measured(fn: Callable[..., Any], job: tuple) -> tuple[Any, float]:
    from hyco.artifacts import peak_rss_mb

    return fn(*job), peak_rss_mb()
