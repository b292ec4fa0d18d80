"""Another integer implementation of a QDQ graph: every named activation's codes moved by seeded
random integers. calibrate derives the HTP bounds from it (`evaluate.perturbation_bound`), and
export's smoke perturbs each of its passes by the HTP's measured codes (`smoke.NoisySessions`)."""

from __future__ import annotations

import numpy as np

# Under it a rate takes the short form: (-c, c) with c = 0.5 / (1 - rate) < 1.5 rounds to -1, 0 or 1 only
SHORT_FORM_RATES = 2 / 3


def perturbed_model(model, seed: int, amplitude: dict[str, int], rates: dict[str, float] | None = None):
    """`model` with the codes of every QuantizeLinear output named in `amplitude` moved before each
    DequantizeLinear that reads them, element by element, seeded per tensor (in graph order).
    Without `rates`: each element by an independent random integer in [-T, T] (T: its `amplitude`).
    With `rates` (the HTP's measured mean codes over its worst, per tensor): each element by +-T
    with probability `rate`, else not at all, so the noise has the HTP's worst and its mean.
    (Every element at up to T, where the HTP reaches T on a few, overstated what a trained SLM's
    HTP does 20-fold. A shift shared by a whole tensor would be another implementation too, but
    no kernel rounds every output of a Softmax up by 256 codes.)"""
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list] = {}
    for node in g.node:
        for x in node.input:
            readers.setdefault(x, []).append(node)
    extra, outputs = [], {o.name for o in g.output}
    quantized = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.output[0] in amplitude]
    for k, q in enumerate(quantized):
        codes, scale, t = q.output[0], q.input[1], amplitude[q.output[0]]
        for dq in [n for n in readers.get(codes, []) if n.op_type == "DequantizeLinear"]:
            y = dq.output[0]
            noisy, base = y + "__perturbed", f"{y}__noise"
            if y in outputs:  # a graph output: it keeps its name, on the perturbed values
                dq.output[0], noisy, y = y + "__exact", y, y + "__exact"
            s = float(numpy_helper.to_array(inits[scale]))
            if rates is None:
                extra += [helper.make_node("RandomUniformLike", [y], [base + "_u"], low=-t - 0.499, high=t + 0.499,
                                           seed=float(seed * 100_003 + k), dtype=onnx.TensorProto.FLOAT),
                          helper.make_node("Round", [base + "_u"], [base + "_r"]),
                          helper.make_node("Mul", [base + "_r", base + "_s"], [base])]
                g.initializer.append(numpy_helper.from_array(np.array(s, np.float32), base + "_s"))
            elif rates[codes] < SHORT_FORM_RATES:
                # v uniform in (-c, c) rounds to +-1 where |v| >= 0.5, i.e. w.p. 1 - 0.5 / c = rate,
                # else to 0: the noise below in 4 ops, not 8 (a noisy E2B tree pass took 3.4 s)
                c = 0.5 / (1.0 - max(0.0, rates[codes]))
                extra += [helper.make_node("RandomUniformLike", [y], [base + "_u"], low=-c, high=c,
                                           seed=float(seed * 100_003 + k), dtype=onnx.TensorProto.FLOAT),
                          helper.make_node("Round", [base + "_u"], [base + "_r"]),
                          helper.make_node("Mul", [base + "_r", base + "_s"], [base])]
                g.initializer.append(numpy_helper.from_array(np.array(s * t, np.float32), base + "_s"))
            else:  # u in [-1, 1): |u| < rate w.p. rate, and u's sign is the jump's
                extra += [helper.make_node("RandomUniformLike", [y], [base + "_u"], low=-1.0, high=1.0,
                                           seed=float(seed * 100_003 + k), dtype=onnx.TensorProto.FLOAT),
                          helper.make_node("Abs", [base + "_u"], [base + "_a"]),
                          helper.make_node("Less", [base + "_a", base + "_p"], [base + "_hit"]),
                          helper.make_node("Cast", [base + "_hit"], [base + "_m"], to=onnx.TensorProto.FLOAT),
                          helper.make_node("Sign", [base + "_u"], [base + "_sign"]),
                          helper.make_node("Mul", [base + "_sign", base + "_m"], [base + "_r"]),
                          helper.make_node("Mul", [base + "_r", base + "_s"], [base])]
                g.initializer.extend([numpy_helper.from_array(np.array(s * t, np.float32), base + "_s"),
                                  numpy_helper.from_array(np.array(min(1.0, max(0.0, rates[codes])), np.float32),
                                                          base + "_p")])
            extra.append(helper.make_node("Add", [y, base], [noisy]))
            for r in readers.get(y, []):
                for j, x in enumerate(r.input):
                    if x == y:
                        r.input[j] = noisy
    g.node.extend(extra)  # after every node they read; onnxruntime sorts the graph
    return m
