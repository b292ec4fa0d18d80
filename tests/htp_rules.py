"""The graph rules the HTP backend holds every shipped ONNX graph to (tree.onnx, prefill.onnx,
mtp_step.onnx), as one function the convert and qat tests share:

- no Pow: RMSNorm and GELU write x*x (HTP's Pow is slow and loses precision at fp16);
- RMSNorm as Reciprocal(Sqrt(.)), not a Div by the root: every Reciprocal fed by a Sqrt;
- no LogSoftmax straight after a Mul by a scalar constant (the softcap/temperature scale is
  folded elsewhere: HTP fuses the pair into one op with the wrong range);
- no large negative float constants: masks come from the host at mask_negative, so nothing in
  the graph saturates a 16-bit activation encoding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx


def htp_violations(path: Path) -> list[str]:
    """Every rule the graph at `path` breaks, as readable lines (empty: legal)."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = model.graph.node
    producer = {o: n for n in nodes for o in n.output}
    ops = [n.op_type for n in nodes]
    out = []
    if "Pow" in ops:
        out.append(f"{ops.count('Pow')} Pow nodes")
    if not ops.count("Reciprocal") == ops.count("Sqrt") > 0:
        out.append(f"{ops.count('Reciprocal')} Reciprocal vs {ops.count('Sqrt')} Sqrt (RMSNorm as Reciprocal(Sqrt))")
    out += [f"Reciprocal {n.name} not fed by a Sqrt" for n in nodes
            if n.op_type == "Reciprocal" and (n.input[0] not in producer or producer[n.input[0]].op_type != "Sqrt")]
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer
              if t.data_location != onnx.TensorProto.EXTERNAL and t.data_type == onnx.TensorProto.FLOAT}
    consts.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in nodes
                   if n.op_type == "Constant" and n.attribute[0].name == "value"})
    for n in nodes:
        if n.op_type == "LogSoftmax" and n.input[0] in producer:
            p = producer[n.input[0]]
            if p.op_type == "Mul" and any(i in consts and consts[i].size == 1 for i in p.input):
                out.append(f"LogSoftmax {n.name} right after a Mul by a scalar constant")
    out += [f"constant {name} reaches {float(np.min(v)):.3g}" for name, v in consts.items()
            if v.dtype.kind == "f" and v.size and float(np.min(v)) <= -1e3]
    return out
