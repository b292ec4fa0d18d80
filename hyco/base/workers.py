"""Work in fresh worker processes (spawned, not forked: no inherited sessions or heap).

Two uses: memory that only leaves with its process (the QNN compiler keeps GBs after its session
is gone), and the second core of a 2-core box during single-threaded Python work (calibrate
prepares the tree and prefill graphs side by side). Each worker gets the stage's
glibc heap setting and dies with its parent; its peak RSS comes back with its result and counts
in the parent's peak figure (`artifacts.note_child_peak`, the workers' peaks summed: they ran
together)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from hyco.base.errors import HycoError

_threads = 0  # in a worker: CPU threads for its onnxruntime sessions (0: onnxruntime's one per core)


def cpu_threads() -> int:
    """Intra-op threads for the CPU sessions this process opens (`hyco.qnn.ort.session_for`):
    0 (onnxruntime's default, one per core) outside workers; in a worker its share of the cores,
    so that workers side by side do not oversubscribe them (two workers with two spinning threads
    each on 2 cores spent more CPU seconds in calibrate's prepare phase for nothing); on a thread
    inside `beside_other_work(threads)`, that many."""
    return getattr(_beside, "threads", None) or _threads


_beside = threading.local()  # a thread whose sessions share the cores with another thread's work


@contextlib.contextmanager
def beside_other_work(threads: int | None = None):
    """The CPU sessions this thread opens inside the block do not spin while they wait for work
    (`spins`) and, given `threads`, run on that many (`cpu_threads`): beside another thread's work on
    the same cores, a spinning onnxruntime thread takes CPU from it for nothing, and an operator
    split over both cores waits for the half whose core the other work holds."""
    outer = getattr(_beside, "on", False), getattr(_beside, "threads", None)
    _beside.on, _beside.threads = True, threads
    try:
        yield
    finally:
        _beside.on, _beside.threads = outer


def spins() -> bool:
    """Whether this thread's CPU sessions may spin (onnxruntime's default), see `beside_other_work`."""
    return not getattr(_beside, "on", False)


def in_processes(fn: Callable[..., Any], jobs: Sequence[tuple], what: str, at_once: int | None = None) -> list[Any]:
    """[fn(*job) for job in jobs], each job in a fresh process of its own, `at_once` of them at a
    time (default all). An exception raised in a worker is raised here as it was; a worker that
    dies (out of memory, killed) raises HycoError naming `what`."""
    from hyco.base.memory import note_child_peak, rss_mb

    parent = rss_mb()  # with the RSS after them below: this process's part of the peak while they ran
    spawn = multiprocessing.get_context("spawn")
    at_once = max(1, min(at_once or len(jobs), len(jobs)))
    threads = max(1, (os.cpu_count() or 1) // at_once)
    # one job per process: a process's second QNN compile writes other bytes than a fresh one's
    with concurrent.futures.ProcessPoolExecutor(at_once, mp_context=spawn, initializer=_worker_init,
                                                initargs=(threads,), max_tasks_per_child=1) as pool:
        futures = [pool.submit(_measured, fn, job) for job in jobs]
        try:
            done = [f.result() for f in futures]
        except concurrent.futures.process.BrokenProcessPool:
            raise HycoError(f"{what}: a worker process died (out of memory?)") from None
    # the workers' peaks summed over the `at_once` largest: at most that many ran together
    note_child_peak(sum(sorted((peak for _, peak in done), reverse=True)[:at_once]), parent)
    return [result for result, _ in done]


def _worker_init(threads: int) -> None:
    """glibc's 1 MiB mmap threshold, as the stages' own processes have (the tree's compile in a
    process without it peaked higher), the worker's share of the cores, and death with the
    parent."""
    import ctypes
    import signal

    from hyco.base.memory import return_large_blocks

    global _threads
    _threads = threads
    return_large_blocks()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
    except OSError:
        pass  # no glibc: the worker outlives a killed parent until its job ends


def _measured(fn: Callable[..., Any], job: tuple) -> tuple[Any, float]:
    from hyco.base.memory import peak_rss_mb

    return fn(*job), peak_rss_mb()


def in_background(fn: Callable[..., Any], job: Any, what: str) -> concurrent.futures.Future:
    """fn(job) in one fresh process (one CPU thread) while this one goes on: its future. A worker
    that dies raises HycoError naming `what` at `.result()`; its peak RSS counts in this process's."""
    from hyco.base.memory import note_child_peak, rss_mb

    parent = rss_mb()
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_worker_init, initargs=(1,))
    inner = pool.submit(_measured, fn, (job,))
    outer: concurrent.futures.Future = concurrent.futures.Future()

    def done(f: concurrent.futures.Future) -> None:
        try:
            result, peak = f.result()
            note_child_peak(peak, parent)
            outer.set_result(result)
        except concurrent.futures.process.BrokenProcessPool:
            outer.set_exception(HycoError(f"{what}: a worker process died (out of memory?)"))
        except BaseException as e:  # the worker's own exception, as it was
            outer.set_exception(e)
        pool.shutdown(wait=False)

    inner.add_done_callback(done)
    return outer

