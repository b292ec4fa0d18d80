"""The deployed QDQ graphs run by torch, on a GPU or the CPU: check's fast executor of the drafters.

onnxruntime CPU with optimisations off (what check held the deployed drafters to) takes seconds a
pass at E2B shapes (bench/bench_deployed.py): a real SB-480 check would take weeks. The graphs
are small in kinds: about 25 ONNX ops, static shapes. `TorchGraph` reads the same file and runs
each node as the torch op of the ONNX definition, with the integer parts written out exactly:

- QuantizeLinear: clamp(round_half_even(x / scale) + zero_point) (a division, as onnxruntime's
  MLAS does, not a product with 1/scale), codes kept as int32;
- DequantizeLinear: float32(code - zero_point) * scale, per tensor, per axis or per block of an axis;
- every node whose inputs are all initializers (the weights' DequantizeLinear and layout ops) is
  computed once at load, in those same formulas, so a weight is one float32 tensor.

What differs from onnxruntime is only floating-point summation order (MatMul, ReduceMean, Softmax)
and its approximations (MLAS's Exp, Sigmoid): the last bits of floats, which now and then move a
16-bit code at a rounding boundary (onnxruntime's own order changes with the CPU's SIMD width).
tests/test_qdq_torch.py holds the two to each other op by op; tests/test_check_deployed.py on
the bundle's graphs over a check's real feeds (ids, codes, log-probs and the MAT, bounds stated).

`run(names, feeds)` is onnxruntime's session interface, so the drafters take it as they take an
onnxruntime session. On CUDA, `cuda_graph=True` records one pass into a CUDA graph and replays it
(the graphs' shapes are static; a pass is then a few kernel launches' worth of CPU time, not ~15k);
a capture CUDA refuses leaves that graph eager, and `mode` says why.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from hyco.base.errors import HycoError
from hyco.quant.cuda_graphs import capture, refusal

CODE_DTYPES = {np.dtype(t) for t in ("uint8", "int8", "uint16", "int16", "int32")}
ONNX_CODE_RANGE = {2: (0, 255), 3: (-128, 127), 4: (0, 65535), 5: (-32768, 32767), 6: (-2**31, 2**31 - 1),
                   21: (0, 15), 22: (-8, 7)}  # TensorProto data type -> code range
ONNX_NUMPY = {2: np.uint8, 3: np.int8, 4: np.uint16, 5: np.int16, 6: np.int32, 21: np.uint8, 22: np.int8}


def to_torch(array: np.ndarray, device) -> torch.Tensor:
    """int8 / uint8 codes (and INT4 / INT2, unpacked by onnx to int8) as they are, wider codes as int32,
    other integers as int64, floats as float32."""
    array = np.asarray(array)
    if array.dtype.name in ("int4", "uint4", "int2", "uint2"):
        array = array.astype(np.int8)
    if array.dtype in (np.dtype(np.int8), np.dtype(np.uint8)):
        dtype = array.dtype
    elif array.dtype in CODE_DTYPES:
        dtype = np.int32
    elif np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_:
        dtype = np.int64
    else:
        dtype = np.float32
    return torch.from_numpy(array.astype(dtype, order="C")).to(device)  # astype copies, keeping 0-d shapes


def _along(scale: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A per-axis scale or zero point shaped to broadcast against x."""
    if scale.dim() == 0 or scale.numel() == 1:
        return scale.reshape(())
    shape = [1] * x.dim()
    shape[axis % x.dim()] = -1
    return scale.reshape(shape)


def quantize(x, scale, zero_point=None, *, axis=1, code_range=(0, 255)):
    zp = _along(zero_point, x, axis) if zero_point is not None else 0
    q = torch.round(x / _along(scale, x, axis)) + zp  # torch.round: half to even, as ONNX
    return torch.clamp(q, *code_range).to(torch.int32)


def grid_bounds(scale, zero_point=None, *, code_range=(0, 255)):
    """What `fake_quantize` reads of a QuantizeLinear grid besides its scale, made once at load:
    the code range less the zero point (Python floats for one zero point, float32 tensors on the
    scale's device per axis) and a +0.0 there."""
    zp = zero_point.to(torch.float64) if zero_point is not None else torch.zeros((), dtype=torch.float64,
                                                                                 device=scale.device)
    lower, upper = (code_range[0] - zp).to(torch.float32), (code_range[1] - zp).to(torch.float32)
    if zp.numel() == 1:
        lower, upper = lower.item(), upper.item()
    return lower, upper, torch.zeros((), device=scale.device)


def fake_quantize(x, scale, lower, upper, zero, *, axis=1, addcmul: bool | None = None):
    """DequantizeLinear(QuantizeLinear(x)) in one step, the same values as the two ops: the code
    stays a float (integers up to 2^24 are exact), clamped to the range less the zero point
    (clamp(q, lo - zp, hi - zp) = clamp(q + zp, lo, hi) - zp for integers), and +0.0 is added to
    the product so a code at the zero point comes out +0.0, as onnxruntime's float32(0) * scale
    does, never round's -0.0 (1 / -0.0 is -inf). On a GPU a pass is its kernel launches, so the
    product and the sum are one addcmul there (four kernels); on a CPU a vectorised multiply and
    add are faster than addcmul's broadcast of a 0-d tensor. `addcmul`: None picks by x's device."""
    s = _along(scale, x, axis)
    if not isinstance(lower, float):
        lower, upper = _along(lower, x, axis), _along(upper, x, axis)
    q = torch.round(x / s).clamp_(lower, upper)
    return torch.addcmul(zero, q, s) if (x.is_cuda if addcmul is None else addcmul) else q.mul_(s).add_(0.0)


def dequantize(q, scale, zero_point=None, *, axis=1, block_size=0):
    """float32(q - zero_point) * scale. Codes of up to 16 bits subtract exactly in float32 (one
    float32 copy of a weight, made in place); int32 codes subtract in float64, then round once.
    `block_size`: a scale (and zero point) per block of `block_size` along `axis` (INT2 weights,
    `hyco.quant.int2_blocks`), spread over the block's elements first."""
    spread = (lambda t: t.repeat_interleave(block_size, dim=axis)) if block_size else (lambda t: _along(t, q, axis))
    wide = q.dtype in (torch.int32, torch.int64)
    x = q.to(torch.float64 if wide else torch.float32)
    if zero_point is not None:
        x.sub_(spread(zero_point).to(x.dtype))
    return x.to(torch.float32).mul_(spread(scale))


def _axes(node_attrs, inputs, index=1):
    axes = node_attrs.get("axes")
    if axes is None and len(inputs) > index and inputs[index] is not None:
        axes = inputs[index].tolist()
    return None if axes is None else [int(a) for a in axes]


def _reduce(fn):
    def run(inputs, attrs):
        axes = _axes(attrs, inputs)
        keep = bool(attrs.get("keepdims", 1))
        if not axes:
            return fn(inputs[0], dim=tuple(range(inputs[0].dim())), keepdim=keep)
        return fn(inputs[0], dim=tuple(axes), keepdim=keep)
    return run


def _reshape(inputs, attrs):
    x, shape = inputs[0], [int(s) for s in inputs[1].tolist()]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return x.reshape(shape)


def _slice(inputs, attrs):
    x = inputs[0]
    starts, ends = inputs[1].tolist(), inputs[2].tolist()
    axes = inputs[3].tolist() if len(inputs) > 3 and inputs[3] is not None else list(range(len(starts)))
    steps = inputs[4].tolist() if len(inputs) > 4 and inputs[4] is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        if step < 1:
            raise HycoError(f"Slice with step {step}: only positive steps are emulated")
        size = x.shape[axis]
        start = max(0, min(size, start + size if start < 0 else start))
        end = max(0, min(size, end + size if end < 0 else end))
        index[axis] = slice(start, end, step)
    return x[tuple(index)]


def _gather(inputs, attrs):
    data, indices = inputs
    axis = attrs.get("axis", 0) % data.dim()
    indices = torch.where(indices < 0, indices + data.shape[axis], indices)
    out = torch.index_select(data, axis, indices.reshape(-1))
    return out.reshape(data.shape[:axis] + indices.shape + data.shape[axis + 1:])


def _gather_elements(inputs, attrs):
    data, indices = inputs
    axis = attrs.get("axis", 0) % data.dim()
    return torch.gather(data, axis, torch.where(indices < 0, indices + data.shape[axis], indices))


def _topk(inputs, attrs):
    x, k = inputs[0], int(inputs[1].reshape(-1)[0])
    axis, largest = attrs.get("axis", -1), bool(attrs.get("largest", 1))
    # A stable sort: ties keep the lower index first, as onnxruntime's TopK returns them
    values, indices = torch.sort(x, dim=axis, descending=largest, stable=True)
    return values.narrow(axis, 0, k), indices.narrow(axis, 0, k)


def _unsqueeze(inputs, attrs):
    x, axes = inputs[0], _axes(attrs, inputs)
    rank = x.dim() + len(axes)  # negative axes count from the output's end
    for axis in sorted(a + rank if a < 0 else a for a in axes):
        x = x.unsqueeze(axis)
    return x


def _div(inputs, attrs):
    a, b = inputs
    if not a.is_floating_point() and not b.is_floating_point():
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


OPS: dict[str, Callable] = {
    "QuantizeLinear": lambda i, a: quantize(i[0], i[1], i[2] if len(i) > 2 else None, axis=a.get("axis", 1),
                                            code_range=a["code_range"]),
    # a QuantizeLinear -> DequantizeLinear pair on a constant grid: x, scale and the bounds from grid_bounds
    "FakeQuantize": lambda i, a: fake_quantize(*i, axis=a.get("axis", 1)),
    "DequantizeLinear": lambda i, a: dequantize(i[0], i[1], i[2] if len(i) > 2 else None, axis=a.get("axis", 1),
                                                block_size=a.get("block_size", 0)),
    "MatMul": lambda i, a: torch.matmul(i[0], i[1]),
    "Add": lambda i, a: i[0] + i[1],
    "Sub": lambda i, a: i[0] - i[1],
    "Mul": lambda i, a: i[0] * i[1],
    "Div": _div,
    "Neg": lambda i, a: -i[0],
    "Sqrt": lambda i, a: torch.sqrt(i[0]),
    "Reciprocal": lambda i, a: torch.reciprocal(i[0]),
    "Exp": lambda i, a: torch.exp(i[0]),
    "Log": lambda i, a: torch.log(i[0]),
    "Sigmoid": lambda i, a: torch.sigmoid(i[0]),
    "Tanh": lambda i, a: torch.tanh(i[0]),
    "Softmax": lambda i, a: torch.softmax(i[0], dim=a.get("axis", -1)),
    "ReduceMean": _reduce(torch.mean),
    "ReduceSum": _reduce(torch.sum),
    "ReduceMax": _reduce(lambda x, dim, keepdim: torch.amax(x, dim=dim, keepdim=keepdim)),
    "Reshape": _reshape,
    "Transpose": lambda i, a: i[0].permute(a.get("perm", list(range(i[0].dim()))[::-1])),
    "Slice": _slice,
    "Concat": lambda i, a: torch.cat(list(i), dim=a["axis"]),
    "Unsqueeze": _unsqueeze,
    "Gather": _gather,
    "GatherElements": _gather_elements,
    "TopK": _topk,
    "Shape": lambda i, a: torch.tensor(i[0].shape[a.get("start", 0):a.get("end", None)], dtype=torch.int64),
    "Identity": lambda i, a: i[0],
}


def _digest(array: np.ndarray) -> str:
    return hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8).reshape(-1), digest_size=16).hexdigest()


# Inputs read as Python numbers (shapes, axes, k): bound at load as CPU tensors, so a pass never
# reads one back from the GPU (which a CUDA graph's capture forbids).
STATIC_INPUTS = {"Reshape": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
                 "ReduceMax": (1,), "TopK": (1,)}


class TorchGraph:
    """One QDQ graph on `device`; `run(names, feeds)` as an onnxruntime session's.

    `shared`: a dict the caller keeps across graphs (tree and prefill hold the same weights): a
    folded constant is kept once per content, so two graphs never hold two copies of the model."""

    def __init__(self, path: Path, *, device: str | torch.device = "cpu", shared: dict | None = None,
                 cuda_graph: bool = False):
        import onnx
        from onnx import helper, numpy_helper

        self.path, self.device = Path(path), torch.device(device)
        if not self.path.is_file():
            raise HycoError(f"{self.path}: no such graph")
        # Weights stay on disk until read, one at a time (a graph's external data is GBs at E2B size)
        graph = onnx.load(str(self.path), load_external_data=False).graph
        unknown = sorted({n.op_type for n in graph.node if n.op_type not in OPS})
        if unknown:
            raise HycoError(f"{self.path}: ops {unknown} have no torch emulation (supported: {sorted(OPS)})")
        blocked = [n.name or n.output[0] for n in graph.node if n.op_type == "QuantizeLinear"
                   and any(a.name == "block_size" and a.i for a in n.attribute)]
        if blocked:  # activations on grids per block: not what `_along` broadcasts (block weights are)
            raise HycoError(f"{self.path}: {blocked[0]} quantizes in blocks (block_size); the torch executor emulates "
                            "per-tensor and per-axis activation grids only")
        shared = {} if shared is None else shared
        tensors = {t.name: t for t in graph.initializer}
        self.inputs = [v.name for v in graph.input if v.name not in tensors]
        self.outputs = [o.name for o in graph.output]
        readers: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                readers[name] = readers.get(name, 0) + 1
        consts: dict[str, torch.Tensor] = {}
        keys: dict[str, tuple] = {}  # a constant's content: an initializer's digest, or how it was folded

        def constant(name: str) -> bool:
            if name in consts:
                return True
            if name not in tensors:
                return False
            array = numpy_helper.to_array(tensors[name], base_dir=str(self.path.parent))
            keys[name] = ("init", name, _digest(array))
            consts[name] = shared[keys[name]] if keys[name] in shared else to_torch(array, self.device)
            return True

        self.code_dtypes: dict[str, type] = {}  # QuantizeLinear outputs: their integer dtype
        self.steps: list[tuple[Callable, list, list[str], dict]] = []
        bound: set[str] = set()  # constants a pass reads
        with torch.no_grad():
            for node in graph.node:
                attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
                if node.op_type == "QuantizeLinear":
                    zp = tensors.get(node.input[2]) if len(node.input) > 2 else None
                    code = int(attrs.get("output_dtype") or (zp.data_type if zp is not None else 2))
                    attrs["code_range"] = ONNX_CODE_RANGE[code]
                    self.code_dtypes[node.output[0]] = ONNX_NUMPY[code]
                names = [name or None for name in node.input]
                if all([n is None or constant(n) for n in names]):  # computed once, at load
                    key = (node.op_type, repr(sorted(attrs.items())), tuple(keys.get(n) for n in names))
                    for i, name in enumerate(node.output):
                        keys[name] = (*key, i)
                    if all(keys[name] in shared for name in node.output):
                        outs = tuple(shared[keys[name]] for name in node.output)
                    else:
                        outs = OPS[node.op_type]([consts.get(n) for n in names], attrs)
                        outs = outs if isinstance(outs, tuple) else (outs,)
                    for name, value in zip(node.output, outs, strict=False):
                        consts[name] = value
                else:
                    static = STATIC_INPUTS.get(node.op_type, ())
                    step_inputs = [consts[n].cpu() if i in static and n in consts else n for i, n in enumerate(names)]
                    bound |= {n for n in step_inputs if isinstance(n, str) and n in consts}
                    self.steps.append((OPS[node.op_type], step_inputs, list(node.output), attrs))
                for n in names:  # a weight's ints are dropped once folded into its float32 copy
                    if n is not None and n in readers:
                        readers[n] -= 1
                        if readers[n] == 0 and n in consts and n not in bound and n not in self.outputs:
                            del consts[n]
        for name in bound | set(self.outputs):
            if name in consts:
                shared.setdefault(keys[name], consts[name])
        self.steps = self._fused(self.steps, consts)
        read = {n for _, ins, _, _ in self.steps for n in ins if isinstance(n, str)}
        self.consts = {k: v for k, v in consts.items() if k in read or k in self.outputs}  # folded weights only
        self.last_read = {n: i for i, (_, ins, _, _) in enumerate(self.steps) for n in ins if isinstance(n, str)}
        self.use_cuda_graph = cuda_graph and self.device.type == "cuda"
        self.cuda_graph, self.capture_failed = None, ""

    def _fused(self, steps: list, consts: dict[str, torch.Tensor]) -> list:
        """Each QuantizeLinear whose codes only one DequantizeLinear reads, on the same constant
        grid, as one FakeQuantize step in its place (a third fewer steps a pass, same values); the
        grid's bounds join `consts`."""
        readers: dict[str, list[int]] = {}
        for i, (_, ins, _, _) in enumerate(steps):
            for n in ins:
                if isinstance(n, str):
                    readers.setdefault(n, []).append(i)
        fused, dropped = [], set()
        for i, (op, ins, outs, attrs) in enumerate(steps):
            if i in dropped:
                continue
            codes = outs[0]
            pair = readers.get(codes, [])
            if op is OPS["QuantizeLinear"] and len(pair) == 1 and codes not in self.outputs:
                _, dq_ins, dq_outs, dq_attrs = steps[pair[0]]
                grid = [n for n in ins[1:] if n is not None]
                if (steps[pair[0]][0] is OPS["DequantizeLinear"] and dq_ins[1:] == ins[1:]
                        and dq_attrs.get("axis", 1) == attrs.get("axis", 1) and all(n in consts for n in grid)):
                    zero_point = consts[ins[2]] if len(ins) > 2 and ins[2] is not None else None
                    bounds = grid_bounds(consts[ins[1]], zero_point, code_range=attrs["code_range"])
                    names = [f"{dq_outs[0]}::lower", f"{dq_outs[0]}::upper", "fake_quantize::zero"]
                    consts.update((n, v) for n, v in zip(names, bounds, strict=True)
                                  if isinstance(v, torch.Tensor) and n not in consts)
                    fused.append((OPS["FakeQuantize"], [ins[0], ins[1], *(n if isinstance(v, torch.Tensor) else v
                                                                          for n, v in zip(names, bounds, strict=True))],
                                  dq_outs, attrs))
                    dropped.add(pair[0])
                    continue
            fused.append((op, ins, outs, attrs))
        return fused

    def get_inputs(self):
        return list(self.inputs)

    def _forward(self, env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for i, (op, ins, outs, attrs) in enumerate(self.steps):
            values = [n if not isinstance(n, str) else env[n] if n in env else self.consts[n] for n in ins]
            result = op(values, attrs)
            for name, value in zip(outs, result if isinstance(result, tuple) else (result,), strict=False):
                env[name] = value
            for n in ins:  # an activation is freed after its last reader
                if isinstance(n, str) and self.last_read[n] == i and n in env and n not in self.outputs:
                    del env[n]
        return env

    def _feeds(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise HycoError(f"{self.path}: feeds lack {missing}")
        return {n: to_torch(feeds[n], self.device) for n in self.inputs}

    def run(self, names, feeds):
        names = list(names) if names else self.outputs
        with torch.no_grad():
            env = self._replay(feeds) if self.use_cuda_graph else self._forward(self._feeds(feeds))
            return [self._to_numpy(n, env[n]) for n in names]

    def ops_per_pass(self, feeds) -> dict[str, int]:
        """The ATen ops one eager pass runs, by name, views left out: on a GPU, its kernel launches
        (bench/bench_deployed.py prints their sum)."""
        from hyco.base.compat_torch import op_counts

        with torch.no_grad(), op_counts() as counts:
            self._forward(self._feeds(feeds))
        return dict(counts)

    def _replay(self, feeds):
        """One pass recorded into a CUDA graph on the first call (static shapes: every pass is
        the same kernels on the same buffers), replayed with the feeds copied in. A capture that
        CUDA refuses leaves this graph eager, the reason in `mode`, rather than stop a check."""
        staged = self._feeds(feeds)
        if self.cuda_graph is None:
            try:
                self._capture(staged)
            except RuntimeError as error:
                torch.cuda.synchronize()
                self.cuda_graph, self.use_cuda_graph = None, False
                self.capture_failed = refusal(error)
                return self._forward(staged)
        for n, t in staged.items():
            self.static_in[n].copy_(t)
        self.cuda_graph.replay()
        return self.static_out

    def _capture(self, staged):
        self.static_in = {n: t.clone() for n, t in staged.items()}
        self.cuda_graph, self.static_out = capture(lambda: self._forward(dict(self.static_in)))

    @property
    def mode(self) -> str:
        """How passes run: "CUDA graph replayed", "eager", or eager with why the capture failed."""
        if self.capture_failed:
            return f"eager (CUDA graph capture failed: {self.capture_failed})"
        return "CUDA graph replayed" if self.use_cuda_graph else "eager"

    def _to_numpy(self, name: str, value: torch.Tensor) -> np.ndarray:
        array = value.detach().cpu().numpy()
        return array.astype(self.code_dtypes[name]) if name in self.code_dtypes else array


def torch_device(spec: str) -> torch.device:
    """`auto`: the first CUDA device when there is one, else the CPU."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise HycoError(f"check.deployed_device must be 'auto', 'cpu' or a CUDA device, but got {spec!r}") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HycoError(f"check.deployed_device is {spec!r}, but torch sees no CUDA device here")
    return device
