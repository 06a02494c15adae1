"""A minimal GGUF reader: header fields and tensor views over a memory map, in one quick pass.

``gguf.GGUFReader`` builds a numpy view per array element at open (49152
vocabulary strings and 48900 merges for SmolLM2: seconds, in every process that
opens the file). This reads the same header with ``struct`` and ``np.frombuffer``
in a fraction of that. Layout (GGUF v2/v3, little-endian): magic ``GGUF``,
version, tensor count, field count; the fields (key, type, value); the tensor
infos (name, dims innermost first, type, offset); then the data, aligned to
``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9
# ggml type id -> (name, weights per block, bytes per block) for the types read without the gguf package
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}


@dataclass(frozen=True)
class GGMLType:
    value: int
    name: str


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as torch sees it: outermost first
    tensor_type: GGMLType
    data: np.ndarray  # raw bytes (uint8) of the tensor, a view of the memory map


class GGUFFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._mm)  # type: ignore[arg-type]  # np.memmap is a buffer; numpy's stubs lack __buffer__
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, tuple(reversed(dims)), self._scalar(4), self._scalar(10)))
        align = int(self.fields.get("general.alignment", 32))
        start = (self._pos + align - 1) // align * align
        self.tensors: list[GGUFTensor] = []
        for name, shape, type_id, offset in infos:
            tname, block, size = _type_info(type_id)
            n = int(np.prod(shape)) if shape else 1
            nbytes = n // block * size
            begin = start + offset
            if begin + nbytes > len(self._mm):
                raise ValueError(f"tensor '{name}' runs past the end of the file (truncated download?)")
            self.tensors.append(GGUFTensor(name, shape, GGMLType(type_id, tname), self._mm[begin : begin + nbytes]))

    def _scalar(self, t: int) -> Any:
        fmt = _SCALARS[t]
        (v,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        s = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8", "replace")
        self._pos += n
        return s

    def _value(self, t: int) -> Any:
        if t == _STRING:
            return self._string()
        if t == _ARRAY:
            sub, n = self._scalar(4), self._scalar(10)
            if sub in _NP:
                arr: np.ndarray = np.frombuffer(self._buf, dtype=_NP[sub], count=n, offset=self._pos)
                self._pos += arr.nbytes
                return arr.tolist()
            return [self._value(sub) for _ in range(n)]
        if t not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {t}")
        return self._scalar(t)


def _type_info(type_id: int) -> tuple[str, int, int]:
    if type_id in GGML_TYPES:
        return GGML_TYPES[type_id]
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        qt = GGMLQuantizationType(type_id)
        block, size = GGML_QUANT_SIZES[qt]
        return qt.name, block, size
    except ImportError:
        raise ValueError(f"tensor type {type_id} needs the 'gguf' package (pip install gguf)") from None
    except (ValueError, KeyError):
        raise ValueError(f"unknown GGML tensor type {type_id}") from None
