"""Which INT2 block size the SLM's 2-bit weights should ship with: one E2B-shaped 2-bit layer
compiled for the HTP at each block size, against the same ints in INT4 containers.

    .venv/bin/python bench/bench_int2_blocks.py [--soc-model 87] [--blocks 16 32 64 128 256 0]
        [--shapes 1536x12288 12288x1536] [--json FILE]

A shape is K x N (inputs x outputs): E2B's 2-bit weights are the MLPs of its 20 KV-shared layers,
gate/up 1,536 -> 12,288 and down 12,288 -> 1,536, and the keep-set head (K 1,536). Block 0 is one
block spanning all of K. Each case: 33 rows of 16-bit activations times random ints in [-2, 1]
with one scale per output channel (repeated in every block, as `hyco.quant.int2_blocks` writes them),
compiled with onnxruntime-qnn (prepare only), then run once on the HTP (the x86 simulator here),
each in a fresh process (HTP results leak between sessions in one process). Figures per case:
the context binary's bytes, against the ints at 2 bits (K N / 4); the largest difference from a
float64 reference computed from the input's codes, in steps of the output's 16-bit grid (calibrate
holds a MatMul to 512); the compile seconds. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ("1536x12288", "12288x1536")
BLOCKS = (16, 32, 64, 128, 256, 0)


def one_case(k: int, n: int, encoding: str, block: int, soc_model: int) -> dict:
    """(A worker's job.) One layer compiled and run on the HTP."""
    from hyco.qnn.contexts import compile_and_run
    from hyco.qnn.int2_probe import MatMulCase, matmul_graph

    case = MatMulCase.draw(k, n)
    model = matmul_graph(case.weights, case.scales, encoding, block, case.x_scale, case.y_scale)
    with tempfile.TemporaryDirectory(prefix="bench-int2-") as tmp:
        run = compile_and_run(model, Path(tmp), soc_model, case.x)
    return {"binary_bytes": run["binary_bytes"], "compile_s": run["compile_s"], "max_codes": round(case.codes_off(run["y"]), 1)}


def cases(shapes: list[str], blocks: list[int]) -> list[tuple[int, int, str, int]]:
    out = []
    for shape in shapes:
        k, n = (int(x) for x in shape.split("x"))
        out.append((k, n, "int4-containers", 0))
        out += [(k, n, "int2-blocks", b or k) for b in blocks if (b or k) <= k and k % (b or k) == 0]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| K x N | encoding | context binary | vs ints at 2 bits | max diff vs float (output codes) | compile s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        name = "INT4 containers" if r["encoding"] == "int4-containers" else (
            f"INT2 blocks of {r['block']}" + (" (= K)" if r["block"] == r["k"] else ""))
        floor = r["k"] * r["n"] / 4
        lines.append(f"| {r['k']:,} x {r['n']:,} | {name} | {r['binary_bytes']:,} B | {r['binary_bytes'] / floor:.3f}x "
                     f"| {r['max_codes']:g} | {r['compile_s']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from hyco.base.workers import in_processes

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--soc-model", type=int, default=87)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), help="K x N, e.g. 1536x12288")
    p.add_argument("--blocks", nargs="+", type=int, default=list(BLOCKS), help="INT2 block sizes; 0: all of K")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    rows = []
    for k, n, encoding, block in cases(args.shapes, args.blocks):
        got = in_processes(one_case, [(k, n, encoding, block, args.soc_model)], f"{encoding} {block} {k}x{n}")[0]
        rows.append({"k": k, "n": n, "encoding": encoding, "block": block, **got})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
