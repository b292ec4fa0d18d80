"""Read a QNN context binary's own metadata through libQnnSystem (ctypes, no QNN headers needed).

`QnnSystemInterface_getProviders` -> `systemContextCreate` -> `systemContextGetBinaryInfo`: the
SoC the binary was built for, the SDK build id, and each graph's name and input/output tensors
(name, dims, data type, scale/offset), as the phone's QNN runtime will see them. Struct layouts
follow QNN's public QnnTypes.h / QnnSystemContext.h / QnnSystemInterface.h (SDK 2.x): every
version of those structs only appends fields, so reading the common prefix is safe.
"""

from __future__ import annotations

import ctypes as C
from pathlib import Path
from typing import Any

import numpy as np

from hyco.base.errors import HycoError


class _Version(C.Structure):
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32), ("patch", C.c_uint32)]


class _ScaleOffset(C.Structure):
    _fields_ = [("scale", C.c_float), ("offset", C.c_int32)]


class _BwAxisScaleOffset(C.Structure):  # the widest inline member of the encoding union (32 bytes)
    _fields_ = [("bitwidth", C.c_uint32), ("axis", C.c_int32), ("numElements", C.c_uint32),
                ("scales", C.c_void_p), ("offsets", C.c_void_p)]


class _AxisScaleOffset(C.Structure):
    _fields_ = [("axis", C.c_int32), ("numScaleOffsets", C.c_uint32), ("scaleOffset", C.POINTER(_ScaleOffset))]


class _Encoding(C.Union):
    _fields_ = [("scaleOffset", _ScaleOffset), ("axisScaleOffset", _AxisScaleOffset),
                ("bwAxisScaleOffset", _BwAxisScaleOffset)]


class _QuantizeParams(C.Structure):
    _fields_ = [("encodingDefinition", C.c_int32), ("quantizationEncoding", C.c_int32), ("u", _Encoding)]


class _SparseParams(C.Structure):
    _fields_ = [("type", C.c_int32), ("numSpecifiedElements", C.c_uint32), ("numSparseDimensions", C.c_uint32)]


class _TensorV2(C.Structure):  # V1 is the prefix up to the data union
    _fields_ = [("id", C.c_uint32), ("name", C.c_char_p), ("type", C.c_int32), ("dataFormat", C.c_uint32),
                ("dataType", C.c_uint32), ("quantizeParams", _QuantizeParams), ("rank", C.c_uint32),
                ("dimensions", C.POINTER(C.c_uint32)), ("memType", C.c_int32),
                ("data", C.c_void_p * 2), ("isDynamicDimensions", C.c_void_p), ("sparseParams", _SparseParams),
                ("isProduced", C.c_uint8)]


class _Tensor(C.Structure):
    _fields_ = [("version", C.c_uint32), ("v", _TensorV2)]


class _GraphInfoV1(C.Structure):  # V2 and V3 append fields; the union is sized by V3
    _fields_ = [("graphName", C.c_char_p), ("numGraphInputs", C.c_uint32), ("graphInputs", C.POINTER(_Tensor)),
                ("numGraphOutputs", C.c_uint32), ("graphOutputs", C.POINTER(_Tensor)),
                ("numUpdateableTensors", C.c_uint32), ("updateableTensors", C.c_void_p),
                ("graphBlobInfoSize", C.c_uint32), ("graphBlobInfo", C.c_void_p),
                ("startOpIndex", C.c_uint32), ("endOpIndex", C.c_uint32)]


class _GraphInfo(C.Structure):
    _fields_ = [("version", C.c_uint32), ("v", _GraphInfoV1)]


class _BinaryInfoV1(C.Structure):
    _fields_ = [("backendId", C.c_uint32), ("buildId", C.c_char_p), ("coreApiVersion", _Version),
                ("backendApiVersion", _Version), ("socVersion", C.c_char_p), ("hwInfoBlobVersion", _Version),
                ("contextBlobVersion", _Version), ("hwInfoBlobSize", C.c_uint32), ("hwInfoBlob", C.c_void_p),
                ("contextBlobSize", C.c_uint64), ("numContextTensors", C.c_uint32), ("contextTensors", C.c_void_p),
                ("numGraphs", C.c_uint32), ("graphs", C.POINTER(_GraphInfo)), ("platformInfo", C.c_void_p)]


class _BinaryInfoV3(C.Structure):
    _fields_ = [("backendId", C.c_uint32), ("buildId", C.c_char_p), ("coreApiVersion", _Version),
                ("backendApiVersion", _Version), ("socVersion", C.c_char_p), ("contextBlobVersion", _Version),
                ("contextBlobSize", C.c_uint64), ("numContextTensors", C.c_uint32), ("contextTensors", C.c_void_p),
                ("numGraphs", C.c_uint32), ("graphs", C.POINTER(_GraphInfo)), ("platformInfo", C.c_void_p),
                ("contextMetadataSize", C.c_uint32), ("contextMetadata", C.c_void_p), ("socModel", C.c_uint32)]


class _BinaryInfo(C.Structure):
    _fields_ = [("version", C.c_uint32), ("v1", _BinaryInfoV1)]


class _BinaryInfoAsV3(C.Structure):
    _fields_ = [("version", C.c_uint32), ("v3", _BinaryInfoV3)]


_CREATE = C.CFUNCTYPE(C.c_uint64, C.POINTER(C.c_void_p))
_GET_INFO = C.CFUNCTYPE(C.c_uint64, C.c_void_p, C.c_void_p, C.c_uint64, C.POINTER(C.POINTER(_BinaryInfo)),
                        C.POINTER(C.c_uint64))
_FREE = C.CFUNCTYPE(C.c_uint64, C.c_void_p)


class _Interface(C.Structure):
    _fields_ = [("backendId", C.c_uint32), ("providerName", C.c_char_p), ("systemApiVersion", _Version),
                ("systemContextCreate", _CREATE), ("systemContextGetBinaryInfo", _GET_INFO),
                ("systemContextGetMetaData", C.c_void_p), ("systemContextFree", _FREE)]


# Qnn_DataType_t -> numpy name (fixed-point types carry their scale/offset beside)
DTYPES = {0x0008: "int8", 0x0016: "int16", 0x0032: "int32", 0x0064: "int64", 0x0108: "uint8", 0x0116: "uint16",
          0x0132: "uint32", 0x0164: "uint64", 0x0216: "float16", 0x0232: "float32", 0x0264: "float64",
          0x0308: "sfixed8", 0x0316: "sfixed16", 0x0332: "sfixed32", 0x0408: "ufixed8", 0x0416: "ufixed16",
          0x0432: "ufixed32", 0x0508: "bool"}

_lib = None


def _interface() -> _Interface:
    global _lib
    import onnxruntime_qnn

    path = Path(onnxruntime_qnn.get_qnn_htp_path()).with_name("libQnnSystem.so")
    if _lib is None:
        _lib = C.CDLL(str(path))
    providers = C.POINTER(C.POINTER(_Interface))()
    count = C.c_uint32()
    if _lib.QnnSystemInterface_getProviders(C.byref(providers), C.byref(count)) or count.value < 1:
        raise HycoError(f"{path}: QnnSystemInterface_getProviders returned no provider")
    return providers[0].contents


def _tensor(t: _Tensor) -> dict[str, Any]:
    v = t.v
    dims = [int(v.dimensions[i]) for i in range(v.rank)]
    row = {"name": v.name.decode(), "shape": dims, "dtype": DTYPES.get(v.dataType, hex(v.dataType))}
    if v.quantizeParams.encodingDefinition == 1 and v.quantizeParams.quantizationEncoding == 0:
        so = v.quantizeParams.u.scaleOffset
        row["scale"], row["offset"] = float(so.scale), int(so.offset)
    return row


def _dsp_arch(metadata: int | None, size: int) -> int | None:
    """The Hexagon arch an HTP context was built for: its context metadata is {version 1, dspArch}
    (two uint32, QNN_SYSTEM_CONTEXT_HTP_CONTEXT_INFO_BLOB_VERSION_V1); None for any other form."""
    if not metadata or size != 8:
        return None
    version, arch = (C.c_uint32 * 2).from_address(metadata)
    return int(arch) if version == 1 else None


def binary_info(path: Path) -> dict[str, Any]:
    """The metadata QNN itself reads from a context binary (raises HycoError naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise HycoError(f"{path}: context binary not found")
    # Mapped, not read: a binary is ~1 GB at E2B size, and the bytes + ctypes-buffer copies it
    # was read through stayed alive in a reference cycle (ctypes.cast) until the next gc: export
    # held a whole binary through the next graph's compile.
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    iface = _interface()
    handle = C.c_void_p()
    if iface.systemContextCreate(C.byref(handle)):
        raise HycoError("libQnnSystem: systemContextCreate failed")
    try:
        info = C.POINTER(_BinaryInfo)()
        size = C.c_uint64()
        err = iface.systemContextGetBinaryInfo(handle, C.c_void_p(data.ctypes.data), data.size, C.byref(info),
                                               C.byref(size))
        if err or not info:
            raise HycoError(f"{path}: libQnnSystem cannot read this context binary (error {err}): corrupt or not a "
                            "QNN context binary")
        version = info.contents.version
        htp_arch = None
        if version == 3:
            b = C.cast(info, C.POINTER(_BinaryInfoAsV3)).contents.v3
            soc_model = int(b.socModel)
            htp_arch = _dsp_arch(b.contextMetadata, b.contextMetadataSize)
        elif version in (1, 2):
            b = info.contents.v1
            soc_model = None
        else:
            raise HycoError(f"{path}: unknown QNN binary-info version {version}")
        graphs = []
        for i in range(b.numGraphs):
            g = b.graphs[i].v
            graphs.append({"name": g.graphName.decode(),
                           "inputs": [_tensor(g.graphInputs[j]) for j in range(g.numGraphInputs)],
                           "outputs": [_tensor(g.graphOutputs[j]) for j in range(g.numGraphOutputs)]})
        version_str = lambda v: f"{v.major}.{v.minor}.{v.patch}"
        return {"info_version": int(version), "backend_id": int(b.backendId), "build_id": b.buildId.decode(),
                "core_api": version_str(b.coreApiVersion), "backend_api": version_str(b.backendApiVersion),
                "soc_version": (b.socVersion or b"").decode(), "soc_model": soc_model, "htp_arch": htp_arch,
                "context_blob_bytes": int(b.contextBlobSize), "graphs": graphs}
    finally:
        iface.systemContextFree(handle)
        del data  # unmapped: nothing read from it is used after this
