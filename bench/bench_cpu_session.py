"""A CPU session's pass on one of the project's graphs, with its INT8 weights dequantized once
(`hyco.qnn.ort.dequantize_int8_weights`, what every session does) and dequantized every pass
(as before): the seconds per pass of each, alternated, and whether the outputs are the same bits.

    .venv/bin/python bench/bench_cpu_session.py runs/e2b-shapes/calibrate/tree.parity.qdq.onnx

Feeds: seeded normal floats (x 0.3) for float inputs, zeros for the others (the ring's codes, the
positions): a pass's time does not depend on the values, and the same feeds go to both sessions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np


def feeds_for(model, seed: int = 0) -> dict[str, np.ndarray]:
    from onnx import helper

    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value or 1 for d in i.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        feeds[i.name] = ((rng.standard_normal(shape) * 0.3).astype(dtype) if dtype == np.float32
                         else np.zeros(shape, dtype))
    return feeds


def main() -> None:
    import onnx

    from hyco.qnn.ort import session_for

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph", type=Path, help="an ONNX graph with its weights beside it")
    parser.add_argument("--rounds", type=int, default=4, help="alternations (3 passes each)")
    args = parser.parse_args()
    model = onnx.load(str(args.graph), load_external_data=False)
    feeds = feeds_for(model)

    def session(held: bool):
        start = time.perf_counter()
        s = session_for(onnx.load(str(args.graph), load_external_data=False), args.graph.parent, arena=False,
                        hold_int8=held)
        return s, time.perf_counter() - start

    held, held_open = session(True)
    plain, plain_open = session(False)
    count = len(held.hyco_held_weights[0])
    nbytes = sum(a.nbytes for a in held.hyco_held_weights[0].values())
    times = {"held": [], "per pass": []}
    for _ in range(args.rounds):
        for name, s in (("held", held), ("per pass", plain)):
            s.run(None, feeds)
            start = time.perf_counter()
            for _ in range(3):
                outs = s.run(None, feeds)
            times[name].append((time.perf_counter() - start) / 3)
            if name == "held":
                held_outs = outs
    same = all(np.array_equal(a, b) for a, b in zip(held_outs, outs, strict=True))
    print(f"{args.graph}: {count} INT8 weights held in fp32 ({nbytes / 1e6:,.1f} MB); open {held_open:.1f} s "
          f"(per-pass DQ: {plain_open:.1f} s)")
    for name, v in times.items():
        print(f"  DQ {name:8s}: {statistics.median(v):.3f} s a pass (median of {len(v)} x 3; "
              f"{', '.join(f'{x:.3f}' for x in v)})")
    print(f"  outputs the same bits: {same}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
