"""hyco/base/workers.py: jobs in spawned worker processes, side by side (calibrate's tree and prefill
graphs, export's isolated compiles)."""

from __future__ import annotations

import os
import time

import pytest


def _job(tag: str, seconds: float) -> tuple[str, int, float, float]:
    start = time.time()
    time.sleep(seconds)
    return tag, os.getpid(), start, time.time()


def _fails(path: str) -> None:
    from hyco.base.errors import HycoError

    raise HycoError(f"{path}: tensor 'w' has the wrong shape")


def _dies() -> None:
    os._exit(9)  # as the kernel's OOM killer would leave it: no exception, no result


def test_jobs_run_at_once_in_their_own_processes_and_peaks_add_up(monkeypatch):
    import hyco.base.memory as memory
    from hyco.base.workers import in_processes

    noted = []
    monkeypatch.setattr(memory, "note_child_peak", lambda child, parent: noted.append((child, parent)))
    results = in_processes(_job, [("a", 4.0), ("b", 4.0)], "two sleeps")  # long enough for a slow start
    assert [r[0] for r in results] == ["a", "b"]  # in job order
    assert len({r[1] for r in results} | {os.getpid()}) == 3  # two workers, neither of them this process
    (_, _, start_a, end_a), (_, _, start_b, end_b) = results
    assert start_b < end_a and start_a < end_b  # the sleeps overlapped
    (children, parent), = noted
    assert children > 2 * 5  # two interpreters' peaks, summed (each well over 5 MiB)
    assert parent == pytest.approx(memory.rss_mb(), rel=0.5)  # this process's RSS as they started


def test_a_worker_s_error_is_raised_as_it_was_and_a_dead_worker_is_named():
    from hyco.base.errors import HycoError
    from hyco.base.workers import in_processes

    with pytest.raises(HycoError, match=r"^/x/g\.onnx: tensor 'w' has the wrong shape$"):
        in_processes(_fails, [("/x/g.onnx",)], "checking g")
    with pytest.raises(HycoError, match="calibrate: preparing the SLM graphs: a worker process died"):
        in_processes(_dies, [()], "calibrate: preparing the SLM graphs")


def _threads() -> int:
    from hyco.base.workers import cpu_threads

    return cpu_threads()


def test_workers_take_their_share_of_the_cores_and_sessions_use_it(tmp_path, monkeypatch):
    """Two workers on this machine's cores: each opens CPU sessions with cores // 2 threads (no
    oversubscription); the main process keeps onnxruntime's default (0). A session with one
    thread computes what the default one does, bit for bit (MLAS splits rows and columns across
    threads, never the summation): a 33 x 1,536 x 2,048 INT4 MatMul, as calibrate's graphs have."""
    import numpy as np
    from test_int4_matmul import weight_graph

    from hyco.base import workers
    from hyco.qnn import ort
    from hyco.qnn.ort import ort_session

    monkeypatch.setattr(ort, "SMALL_GRAPH_BYTES", 0)  # this graph is small: keep the default's every-core pool
    assert workers.cpu_threads() == 0
    assert workers.in_processes(_threads, [(), ()], "threads") == [max(1, (os.cpu_count() or 1) // 2)] * 2
    path, _, _ = weight_graph(tmp_path, 2048, 1536, [1, 33], False, seed=3)
    x = np.random.default_rng(0).standard_normal((1, 33, 1536)).astype(np.float32)
    default = ort_session(path)
    monkeypatch.setattr(workers, "_threads", 1)
    single = ort_session(path)
    assert single.get_session_options().intra_op_num_threads == 1
    assert default.get_session_options().intra_op_num_threads == 0
    np.testing.assert_array_equal(single.run(None, {"x": x})[0], default.run(None, {"x": x})[0])


def test_sessions_beside_other_work_take_their_share_and_do_not_spin():
    """A thread inside `beside_other_work(1)` opens sessions on one core that do not spin; a
    nested block restores the outer one's setting, and another thread keeps the defaults."""
    import threading

    from hyco.base import workers
    from hyco.qnn.ort import session_options

    def options():
        so = session_options()
        try:
            spin = so.get_session_config_entry("session.intra_op.allow_spinning")
        except RuntimeError:  # no entry: onnxruntime's default (spinning)
            spin = None
        return so.intra_op_num_threads, spin

    assert options() == (workers._threads, None)
    with workers.beside_other_work(threads=1):
        assert options() == (1, "0")
        with workers.beside_other_work():
            assert options() == (workers._threads, "0")
        assert options() == (1, "0")
        other = []
        thread = threading.Thread(target=lambda: other.append((workers.cpu_threads(), workers.spins())))
        thread.start()
        thread.join()
        assert other == [(workers._threads, True)]
    assert workers.cpu_threads() == workers._threads and workers.spins()
