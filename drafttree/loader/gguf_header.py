"""A GGUF file's header read from its bytes: the metadata, and where each tensor's data lies.

gguf's `GGUFReader` makes a numpy view of every part of every array element (1.8 M of them for
SmolLM2's 49,152 tokens and 48,900 merges: 2.6 s on two CPU cores). This reads the same header with
`struct` in a few tens of milliseconds and gives each tensor's data as `GGUFReader` does, for gguf's
`dequantize`. The layout (GGUF v2 and v3): magic, version, tensor count, metadata count, the
metadata (key, type, value), the tensor infos (name, dimensions fastest first, type, offset), then
the data, aligned to `general.alignment`.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
          10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


class Truncated(ValueError):
    """The header runs past the file's end or holds what GGUF does not define."""


@dataclass
class Tensor:
    name: str
    tensor_type: Any           # gguf.GGMLQuantizationType
    shape: tuple[int, ...]     # as stored: the fastest dimension first
    n_bytes: int
    data_offset: int           # from the file's start
    data: np.ndarray           # as GGUFReader gives it: elements, or a quantized type's bytes per row


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        except struct.error as e:
            raise Truncated(f"the header ends at byte {self.pos}: {e}") from None
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.buf):
            raise Truncated(f"a string of {n} bytes at byte {self.pos} runs past the file's end")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, n = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dt = np.dtype(_NUMPY[item]).newbyteorder("<")
                if self.pos + n * dt.itemsize > len(self.buf):
                    raise Truncated(f"an array of {n} items at byte {self.pos} runs past the file's end")
                out = np.frombuffer(self.buf, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return out
            return [self.value(item) for _ in range(n)]
        raise Truncated(f"unknown value type {kind} at byte {self.pos}")


@dataclass
class GGUFHeader:
    fields: dict[str, Any]     # metadata: numbers, strings, numpy arrays of numbers, lists of strings
    tensors: list[Tensor]
    version: int

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value


def read_header(path: Path) -> GGUFHeader:
    """The file's metadata and tensors; Truncated where the header is cut short or malformed, and
    where a tensor's data runs past the file's end."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    c = _Cursor(memoryview(raw))
    if bytes(c.buf[:4]) != b"GGUF":
        raise Truncated("no GGUF magic")
    c.pos = 4
    version, n_tensors, n_kv = c.scalar("<I"), c.scalar("<Q"), c.scalar("<Q")
    if version not in (2, 3):
        raise Truncated(f"GGUF version {version} (2 and 3 are read)")
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.scalar("<I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
        infos.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    if align <= 0 or align & (align - 1):
        raise Truncated(f"alignment {align} is not a power of two")
    start = -(-c.pos // align) * align
    plain = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise Truncated(f"tensor {name!r} twice")
        names.add(name)
        try:
            ggml_type = GGMLQuantizationType(kind)
        except ValueError:
            raise Truncated(f"tensor {name!r} of unknown type {kind}") from None
        block, size = GGML_QUANT_SIZES[ggml_type]
        n_bytes = int(np.prod(dims)) * size // block
        at = start + offset
        if at + n_bytes > len(raw):
            raise Truncated(f"tensor {name!r} needs bytes [{at}, {at + n_bytes}) but the file has {len(raw)}")
        np_dims = tuple(reversed(dims))
        if ggml_type in plain:
            data = raw[at:at + n_bytes].view(plain[ggml_type]).reshape(np_dims)
        else:
            data = raw[at:at + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
        tensors.append(Tensor(name, ggml_type, dims, n_bytes, at, data))
    return GGUFHeader(fields, tensors, version)
