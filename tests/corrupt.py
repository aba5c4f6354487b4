"""Corruptions of a stored safetensors file, the three a hostile tester applies (shared by the tests):

* :func:`flip_exponent_bits` — flip the highest exponent bit of ``count`` floating-point values spread over
  the largest float tensor (a float64 0.5 becomes ~4e307: finite, so only a hash catches it);
* :func:`truncate` — cut the file to ``size`` bytes;
* :func:`fill_7f` — set 64 bytes in the middle of the tensor data to 0x7f (finite values again).
"""
from __future__ import annotations

import json
from pathlib import Path

_FLOAT_BITS = {"F64": (8, 62), "F32": (4, 30), "F16": (2, 14), "BF16": (2, 14)}


def _layout(data: bytes) -> tuple[int, dict]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    return 8 + n, header


def flip_exponent_bits(path: str | Path, count: int = 2000) -> int:
    """Flip the top exponent bit of up to ``count`` values of the largest float tensor; returns how many."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    start, header = _layout(bytes(data))
    floats = [(e["data_offsets"][1] - e["data_offsets"][0], e) for e in header.values() if e["dtype"] in _FLOAT_BITS]
    size, entry = max(floats, key=lambda t: t[0])
    width, bit = _FLOAT_BITS[entry["dtype"]]
    n_values = size // width
    k = min(count, n_values)
    stride = max(1, n_values // k)
    for j in range(k):
        pos = start + entry["data_offsets"][0] + j * stride * width + bit // 8  # little-endian byte of the bit
        data[pos] ^= 1 << (bit % 8)
    path.write_bytes(bytes(data))
    return k


def truncate(path: str | Path, size: int = 5000) -> None:
    path = Path(path)
    data = path.read_bytes()
    assert len(data) > size, f"{path} has only {len(data)} bytes; truncating to {size} would not change it"
    path.write_bytes(data[:size])


def fill_7f(path: str | Path, length: int = 64) -> int:
    """Set ``length`` bytes in the middle of the tensor data to 0x7f; returns the offset."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    start, _ = _layout(bytes(data))
    at = start + (len(data) - start) // 2
    at -= at % 8
    data[at:at + length] = b"\x7f" * length
    path.write_bytes(bytes(data))
    return at
