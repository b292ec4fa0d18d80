"""Small ONNX graph helpers shared by convert's CPU-session rewrites, calibrate's preparation and the INT2 rewrite."""

from __future__ import annotations


def consumers(graph) -> dict[str, list]:
    """Tensor name -> the nodes reading it, in graph order (a node reading it twice, twice)."""
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def loaded(t, folder):
    """`t` (an onnx TensorProto) with its values in memory: itself if they are, else a copy read
    from `folder`, where its external data lies."""
    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    if not uses_external_data(t):
        return t
    out = onnx.TensorProto()
    out.CopyFrom(t)
    load_external_data_for_tensor(out, str(folder))
    del out.external_data[:]
    out.data_location = onnx.TensorProto.DEFAULT
    return out
