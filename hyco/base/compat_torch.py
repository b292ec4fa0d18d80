"""Every private name of torch the project reads, in one place (tests/test_compat.py runs each
on the installed release)."""

from __future__ import annotations

import contextlib
from typing import Any


def is_persistent_buffer(module: Any, leaf: str) -> bool:
    """Whether `module`'s buffer `leaf` is saved in its state dict (torch keeps the non-persistent
    names in a private set)."""
    return leaf not in module._non_persistent_buffers_set


@contextlib.contextmanager
def onnx_shape_inference_without(names: set[str]):
    """The TorchScript exporter's ONNX shape inference (the private
    `torch._C._jit_pass_onnx_graph_shape_type_inference`), blind to the values of `names` for the
    duration. The exporter hands every parameter's value to ONNX shape inference, which serializes
    it into a proto: convert's int stand-ins (zero-stride, one byte each) were expanded to
    contiguous int8 and copied again, 2x the int8 size of each linear at once (GBs for a
    262,144-row output layer). Without the values the inputs keep their traced type and shape,
    which is all a DequantizeLinear needs: the exported graph is byte-identical."""
    from torch import _C

    infer = _C._jit_pass_onnx_graph_shape_type_inference

    def blind(graph, params, opset):
        return infer(graph, {k: v for k, v in params.items() if k not in names}, opset)

    _C._jit_pass_onnx_graph_shape_type_inference = blind
    try:
        yield
    finally:
        _C._jit_pass_onnx_graph_shape_type_inference = infer


@contextlib.contextmanager
def op_counts():
    """A Counter of the ATen ops that run inside the block, by name, views left out (they launch
    no kernel): on a GPU each is a kernel launch, the cost of a pass of small ops. Read through
    torch's private dispatch-mode base class."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    counts: Counter = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                counts[func.__name__.split(".")[0]] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield counts
