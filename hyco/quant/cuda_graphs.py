"""One pass recorded as a CUDA graph, as torch asks it done (the server sweep's fixed shapes and
the torch executor's deployed graphs both replay one), and the one-line reason a refused capture
is reported by."""

from __future__ import annotations

import torch


def capture(run, reset=None, warmups: int = 1):
    """run() as one CUDA graph: warmed up `warmups` times on a side stream (kernels chosen,
    allocator settled), `reset()` before each run and before the capture, captured once. Returns
    the graph and the output every replay writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            if reset is not None:
                reset()
            run()
    torch.cuda.current_stream().wait_stream(stream)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph, output


def refusal(error: BaseException) -> str:
    """A refused capture in one line: the error's type and its message's first line."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
