"""Small ONNX graph lookups shared by convert's CPU-session rewrites and calibrate's preparation."""

from __future__ import annotations


def consumers(graph) -> dict[str, list]:
    """Tensor name -> the nodes reading it, in graph order (a node reading it twice, twice)."""
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers
