"""CPU sessions: each INT4 weight's DequantizeLinear -> MatMul as one MatMulNBits.

onnxruntime's CPU DequantizeLinear is a scalar loop: on the 35-layer E2B-shaped tree.onnx
(2.0 G INT4 weights) it took most of a pass, more than the MatMuls, and every tool that runs
these graphs on the CPU (convert's parity, calibrate's recording, calibration, fidelity, the
runtime check) paid it on every pass. onnxruntime's own MatMulNBits (com.microsoft) multiplies
straight from packed 4-bit weights, dequantizing a tile at a time in cache, multithreaded.

Same integers, same scales: MatMulNBits stores unsigned nibbles with a zero point (8 for 4 bits
by default), so a two's-complement nibble v is stored as v + 8, which is v's nibble XOR 0x8: an
[N, K] weight's packed bytes XOR 0x88 are MatMulNBits' B as they stand. Its scales are per block
of K; the per-channel scale is repeated over each row's blocks. Not bit-identical to DQ -> MatMul:
accuracy_level 0 computes in fp32 as MLAS's SGEMM does, but in another summation order, so the
outputs differ in the last bits (tests/test_int4_matmul.py holds sessions to each other at a
stated bound). INT8 weights keep DequantizeLinear (1% of E2B's weight; MatMulNBits' 8-bit path
is slower than DequantizeLinear -> Gemm here). An INT2-block weight whose every block carries its
channel's scale (`hyco.quant.int2_blocks`: calibrate's deployable graphs) holds the same numbers as INT4
per channel: its ints are repacked into MatMulNBits' 4-bit B the same way.

For CPU sessions only (`hyco.qnn.ort.session_for`): the graphs on disk and the deployed
ones keep DequantizeLinear -> MatMul, which is what the HTP's QDQ matcher reads.

Repacking costs seconds per E2B-sized session (the repack, then writing the GB-sized folder), and
calibrate reads convert's graphs twice (recording, then fidelity): inside
`shared_repacks(convert)` their sessions read one folder in which each source tensor was repacked
(or copied) and written once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hyco.quant.onnx_graph import consumers as graph_consumers

FUSED_DATA = "int4_matmul.data"  # the session's repacked weights, in a folder of its own
_shared: dict | None = None  # shared_repacks' folder and index while its block runs
# sessions may open on two threads at once (calibrate's float fidelity passes beside its quantize):
# one writer appends to the shared file and index at a time
_shared_lock = threading.Lock()


@contextlib.contextmanager
def shared_repacks(*sources: Path) -> Iterator[Path]:
    """Within the block, the CPU sessions `session_for` opens over graphs whose weights lie in one
    of the `sources` folders share one folder of external data: a source tensor (its file's
    identity, offset and length, and how it is repacked) is written there once and every later
    session points at those bytes. Graphs elsewhere (read once) keep a folder of their own, so the
    shared one holds only what is read again. The folder goes when the block ends; a nested
    block uses the outer one's, its own sources added while it lasts."""
    global _shared
    if _shared is not None:
        added = {Path(p).resolve() for p in sources} - _shared["sources"]
        _shared["sources"] |= added
        try:
            yield _shared["folder"]
        finally:
            _shared["sources"] -= added
        return
    folder = Path(tempfile.mkdtemp(prefix="hyco-int4-shared-"))
    _shared = {"folder": folder, "index": {}, "sources": {Path(p).resolve() for p in sources}}
    try:
        yield folder
    finally:
        _shared = None
        shutil.rmtree(folder, ignore_errors=True)


def shares_repacks(folder: Path) -> bool:
    """Whether `folder` is the open `shared_repacks` folder (its block removes it, not a session)."""
    return _shared is not None and Path(folder) == _shared["folder"]


def _source_key(tensor, folder: Path, how: tuple) -> tuple | None:
    """Identity of an external tensor's bytes as they are now (a rewritten file gets a new key),
    or None for a tensor stored in the graph itself."""
    from onnx.external_data_helper import uses_external_data

    if not uses_external_data(tensor):
        return None
    info = {e.key: e.value for e in tensor.external_data}
    path = folder / info["location"]
    try:
        st = path.stat()
    except OSError:
        return None  # _read_raw names the missing file
    return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, info.get("offset", "0"),
            info.get("length"), how)


def _store(data, index: dict | None, key: tuple | None, make) -> tuple[int, int]:
    """(offset, length) in `data` of the bytes `make()` returns, written unless `index` holds `key`."""
    if index is not None and key is not None and key in index:
        return index[key]
    raw = make()
    place = (data.tell(), len(raw))
    data.write(raw)
    if index is not None and key is not None:
        index[key] = place
    return place


def block_size(k: int) -> int:
    """The largest power of two <= 256 dividing K (16 at least; MatMulNBits pads the last block)."""
    size = 16
    while size < 256 and k % (size * 2) == 0:
        size *= 2
    return size


def matmul_nbits_weight(raw: bytes, shape: tuple[int, int], transposed: bool) -> np.ndarray:
    """An ONNX INT4 weight's raw bytes -> MatMulNBits' B, uint8 [N, blocks, block_size / 2].
    `shape`: the initializer's; [N, K] feeding Transpose -> MatMul (convert's graphs), or [K, N]
    feeding MatMul directly (`transposed`, calibrate's prepared graphs)."""
    from hyco.formats.int4 import transpose_int4

    n, k = (shape[1], shape[0]) if transposed else shape
    size = block_size(k)
    blocks = -(-k // size)
    if k % size == 0 and n % 2 == 0:
        # two's-complement nibble -> offset-8 nibble: XOR 0x8 per nibble; [N, K] bytes stay in place
        packed = np.frombuffer(transpose_int4(raw, (k, n)) if transposed else raw, np.uint8)
        return (packed ^ np.uint8(0x88)).reshape(n, blocks, size // 2)
    # odd N or a K off the block grid: through one uint8 per nibble (offset-8 by the same XOR;
    # faster than int8 via int16 for the keep-set output layer, 86,089 x 1,536)
    packed = np.frombuffer(raw, np.uint8)
    nibbles = np.empty(2 * packed.size, np.uint8)
    nibbles[0::2], nibbles[1::2] = packed & 0x0F, packed >> 4
    offset8 = (nibbles[:shape[0] * shape[1]] ^ np.uint8(0x8)).reshape(shape)
    rows = np.full((n, blocks * size), 8, np.uint8)  # padding: nibble 8, the value 0
    rows[:, :k] = offset8.T if transposed else offset8
    return (rows[:, 0::2] | (rows[:, 1::2] << 4)).reshape(n, blocks, size // 2)


def _read_raw(tensor, folder: Path) -> bytes:
    from onnx.external_data_helper import uses_external_data

    from hyco.base.errors import HycoError

    if not uses_external_data(tensor):
        if tensor.HasField("raw_data"):
            return tensor.raw_data
        from onnx import TensorProto, numpy_helper

        from hyco.formats.int4 import pack_int4

        values = numpy_helper.to_array(tensor)  # typed fields (int32_data, float_data)
        return pack_int4(values) if tensor.data_type == TensorProto.INT4 else values.tobytes()
    info = {e.key: e.value for e in tensor.external_data}
    path = folder / info["location"]
    try:
        with open(path, "rb") as f:
            f.seek(int(info.get("offset", 0)))
            raw = f.read(int(info["length"])) if "length" in info else f.read()
    except OSError as e:
        raise HycoError(f"{path}: cannot read tensor {tensor.name!r} ({e.strerror})") from None
    if "length" in info and len(raw) != int(info["length"]):
        raise HycoError(f"{path}: truncated: tensor {tensor.name!r} needs {info['length']} bytes at offset "
                        f"{info.get('offset', 0)}, the file holds {len(raw)} of them")
    return raw


def _float_array(tensor, folder: Path) -> np.ndarray:
    return np.frombuffer(_read_raw(tensor, folder), np.float32)


def _point_at(tensor, offset: int, length: int) -> None:
    from onnx import TensorProto

    del tensor.external_data[:]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", FUSED_DATA), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)


def _single_user(name: str, consumers: dict, outputs: set[str]):
    users = consumers.get(name, [])
    return users[0] if len(users) == 1 and name not in outputs else None


def _int2_blocks_per_channel(dq, inits: dict, folder: Path) -> bool:
    """Whether `dq` holds INT2 weights [K, N] in blocks along K (`hyco.quant.int2_blocks`) whose every
    block carries its channel's scale and a zero point of 0: the same numbers as INT4 per channel."""
    from onnx import TensorProto

    weight, scale = inits[dq.input[0]], inits[dq.input[1]]
    zero = inits.get(dq.input[2]) if len(dq.input) > 2 else None
    if (weight.data_type != TensorProto.INT2 or len(weight.dims) != 2 or scale.data_type != TensorProto.FLOAT
            or zero is None or next((a.i for a in dq.attribute if a.name == "axis"), 1) != 0):
        return False
    size = next(a.i for a in dq.attribute if a.name == "block_size")
    k, n = weight.dims
    if k % size or list(scale.dims) != [k // size, n] or any(_read_raw(zero, folder)):
        return False
    blocks = _float_array(scale, folder).reshape(k // size, n)
    return bool((blocks == blocks[0]).all())


def _fusable(dq, inits: dict, consumers: dict, outputs: set[str], folder: Path):
    """(MatMul, activation, transposed, nodes replaced) for an INT4 per-channel weight DQ (or an
    INT2-block one holding the same numbers, `_int2_blocks_per_channel`) that feeds one MatMul as
    its B, directly or through Transpose([1, 0]); else None."""
    from onnx import TensorProto

    if (dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or len(dq.input) < 2
            or dq.input[1] not in inits):
        return None
    if any(a.name == "block_size" and a.i for a in dq.attribute):
        return _fusable_int2_blocks(dq, inits, consumers, outputs, folder)
    weight, scale = inits[dq.input[0]], inits[dq.input[1]]
    if weight.data_type != TensorProto.INT4 or len(weight.dims) != 2 or scale.data_type != TensorProto.FLOAT:
        return None
    if len(dq.input) > 2 and dq.input[2]:
        # onnxruntime's quantizer writes explicit zero points for the weights it keeps; symmetric
        # (all 0) is what convert wrote, anything else stays as it is
        zero = inits.get(dq.input[2])
        if zero is None or zero.data_type != TensorProto.INT4 or any(_read_raw(zero, folder)):
            return None
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    user = _single_user(dq.output[0], consumers, outputs)
    if user is None:
        return None
    replaced, transposed = [dq], True
    if user.op_type == "Transpose":
        if [list(a.ints) for a in user.attribute if a.name == "perm"] not in ([[1, 0]], []):
            return None
        replaced, transposed = [dq, user], False
        user = _single_user(user.output[0], consumers, outputs)
    if user is None or user.op_type != "MatMul" or user.input[1] != replaced[-1].output[0]:
        return None
    out_axis = 1 if transposed else 0  # scales run along N
    n = weight.dims[out_axis]
    if list(scale.dims) not in ([], [1], [n]) or (list(scale.dims) == [n] and axis % 2 != out_axis):
        return None
    return user, user.input[0], transposed, replaced


def _fusable_int2_blocks(dq, inits: dict, consumers: dict, outputs: set[str], folder: Path):
    """`_fusable` for an INT2-block weight [K, N] feeding one MatMul as its B directly (the layout
    calibrate's deployable graphs hold)."""
    if not _int2_blocks_per_channel(dq, inits, folder):
        return None
    user = _single_user(dq.output[0], consumers, outputs)
    if user is None or user.op_type != "MatMul" or user.input[1] != dq.output[0]:
        return None
    return user, user.input[0], True, [dq]


def _int4_raw(weight, folder: Path) -> bytes:
    """A weight's ints as ONNX INT4 raw data (INT2 ones unpacked and packed two per byte)."""
    from onnx import TensorProto

    from hyco.formats.int4 import pack_int4
    from hyco.quant.int2_blocks import unpack_int2

    raw = _read_raw(weight, folder)
    if weight.data_type == TensorProto.INT2:
        return pack_int4(unpack_int2(raw, int(np.prod(weight.dims))))
    return raw


def fuse_int4_matmuls(model, weights_folder: Path) -> tuple[int, Path | None]:
    """Rewrite `model` in place (weightless, external data in `weights_folder`); returns how many
    MatMuls were fused and the folder the session must read external data from: a new temporary
    folder holding the repacked weights and the graph's other external tensors, which the caller
    removes once the session has loaded (`session_for`), or `shared_repacks`' folder inside its
    block, or None when nothing was fused."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = graph_consumers(graph)
    outputs = {o.name for o in graph.output}
    plans = {}
    for node in graph.node:
        plan = _fusable(node, inits, consumers, outputs, Path(weights_folder))
        if plan is not None:
            plans[id(plan[0])] = (node, *plan)
    if not plans:
        return 0, None
    if _shared is not None and Path(weights_folder).resolve() in _shared["sources"]:
        with _shared_lock:
            _write_fused(model, Path(weights_folder), _shared["folder"], plans, inits, outputs, _shared["index"])
        return len(plans), _shared["folder"]
    folder = Path(tempfile.mkdtemp(prefix="hyco-int4-matmul-"))
    try:
        _write_fused(model, Path(weights_folder), folder, plans, inits, outputs)
    except BaseException:
        shutil.rmtree(folder)
        raise
    return len(plans), folder


def _write_fused(model, weights_folder: Path, folder: Path, plans: dict, inits: dict, outputs: set[str],
                 index: dict | None = None) -> None:
    """`index`: shared_repacks' (source key -> place in FUSED_DATA), appended to; None: a fresh file."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.external_data_helper import uses_external_data

    graph = model.graph
    dropped, nodes, repacked = set(), [], set()
    mode = "wb" if index is None else "ab"
    with open(folder / FUSED_DATA, mode) as data:
        for node in graph.node:
            if id(node) not in plans:
                nodes.append(node)
                continue
            dq, matmul, act, transposed, replaced = plans[id(node)]
            weight, scale = inits[dq.input[0]], _float_array(inits[dq.input[1]], Path(weights_folder))
            n, k = (weight.dims[1], weight.dims[0]) if transposed else tuple(weight.dims)
            blocks = -(-k // block_size(k))
            key = _source_key(weight, Path(weights_folder), ("nbits", tuple(weight.dims), transposed))
            place = _store(data, index, key, lambda w=weight, t=transposed: matmul_nbits_weight(
                _int4_raw(w, Path(weights_folder)), tuple(w.dims), t).tobytes())
            scale = scale[:n]  # INT2 blocks: every block row is the channel's scale (_int2_blocks_per_channel)
            tag = f"{matmul.name or matmul.output[0]}/nbits"
            b_tensor = TensorProto(name=f"{tag}/B", data_type=TensorProto.UINT8, dims=(n, blocks, block_size(k) // 2))
            _point_at(b_tensor, *place)
            scales = numpy_helper.from_array(np.repeat(np.broadcast_to(scale, (n,)), blocks).astype(np.float32),
                                             f"{tag}/scales")
            graph.initializer.extend([b_tensor, scales])
            repacked.add(b_tensor.name)
            nodes.append(helper.make_node("MatMulNBits", [act, b_tensor.name, scales.name], list(matmul.output),
                                          domain="com.microsoft", K=k, N=n, bits=4, block_size=block_size(k),
                                          name=tag))
            dropped.update(id(r) for r in replaced)
    del graph.node[:]
    graph.node.extend(n for n in nodes if id(n) not in dropped)
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used or t.name in outputs]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    with open(folder / FUSED_DATA, "ab") as data:
        # onnxruntime reads external data from one folder only (links out of it are refused): the
        # graph's other external tensors (norms, scales, INT8 weights: ~1% here) are copied along
        for tensor in graph.initializer:  # (extend copied `kept`: change the graph's own)
            if uses_external_data(tensor) and tensor.name not in repacked:
                key = _source_key(tensor, Path(weights_folder), ("raw",))
                _point_at(tensor, *_store(data, index, key, lambda t=tensor: _read_raw(t, Path(weights_folder))))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
