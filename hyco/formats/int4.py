"""ONNX INT4 raw data: pack, unpack and transpose, byte by byte (two's-complement nibbles,
element 2k in the low nibble of byte k)."""

from __future__ import annotations

import numpy as np


def pack_int4(ints: np.ndarray) -> bytes:
    """ONNX INT4 raw data: two's-complement nibbles, element 2k in the low nibble of byte k."""
    flat = ints.astype(np.int8).reshape(-1)
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.int8)])
    nibbles = flat.view(np.uint8) & 0x0F
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8).tobytes()


# a byte of ONNX INT4 -> its low / high nibble's signed value
_NIBBLE = np.where(np.arange(16) >= 8, np.arange(16) - 16, np.arange(16)).astype(np.int8)
INT4_LOW, INT4_HIGH = _NIBBLE[np.arange(256) & 15], _NIBBLE[np.arange(256) >> 4]


def unpack_int4(raw: bytes, count: int) -> np.ndarray:
    """ONNX INT4 raw data -> `count` int8 values, through the nibble tables (faster than the int16 route)."""
    b = np.frombuffer(raw, dtype=np.uint8)
    out = np.empty(2 * b.size, np.int8)
    out[0::2], out[1::2] = INT4_LOW[b], INT4_HIGH[b]
    return out[:count]


def transpose_int4(raw: bytes, shape: tuple[int, int]) -> bytes:
    """ONNX INT4 raw data of an [R, C] matrix -> that of its [C, R] transpose, R and C even, byte
    by byte: row 2m of the result takes the low nibbles of rows 2j and 2j + 1, row 2m + 1 their
    high nibbles. Several times faster than through int8 and back (unpack, .T, pack)."""
    rows, cols = shape
    if rows % 2 or cols % 2:
        return pack_int4(unpack_int4(raw, rows * cols).reshape(rows, cols).T)
    packed = np.frombuffer(raw, np.uint8).reshape(rows, cols // 2)
    even, odd = packed[0::2], packed[1::2]
    out = np.empty((cols, rows // 2), np.uint8)
    out[0::2] = ((even & 0x0F) | (odd << 4)).T
    out[1::2] = ((even >> 4) | (odd & 0xF0)).T
    return out.tobytes()
