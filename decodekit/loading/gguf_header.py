"""A GGUF file's metadata and tensor table, read straight into plain values, and its tensors as views of one map.

The `gguf` package's reader makes a numpy array of every part of every value (a length and its bytes for each of a
vocabulary's strings: some 200,000 arrays for a 49,152-token vocabulary and its merges), which took 160 MB at its peak
and left 85 MB in the process after it was let go (memory its small objects held, returned to no one), against 92 MB
for the default model's weights. Here a string array becomes one list of str, a numeric array one numpy array, and
a tensor a view of the file's map made when asked for. The layout read: the GGUF specification (ggml's
docs/gguf.md): magic, version, tensor and field counts, the fields (key, type, value), the tensor table (name,
dimensions innermost first, type, offset), the data from the next multiple of general.alignment. Block sizes and
types come from the `gguf` package (GGML_QUANT_SIZES, GGMLQuantizationType).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
    5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
    12: ("<d", np.float64),
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Tensor types whose data the gguf reader gives as elements; every other type as rows of bytes.
_ELEMENTS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass
class TensorInfo:
    """One entry of the tensor table: `shape` as GGUF lists it (innermost first, as the gguf reader's), `tensor_type`
    (a GGMLQuantizationType), `data_offset` (from the file's start) and `n_bytes`; `data` its bytes as the gguf
    reader shapes them (rows of [row bytes] for block types, the element dtype for float types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any
    data_offset: int
    n_elements: int
    n_bytes: int
    _file: "GGUFHeader"

    @property
    def data(self) -> np.ndarray:
        from gguf import GGML_QUANT_SIZES

        block, size = GGML_QUANT_SIZES[self.tensor_type]
        raw = np.frombuffer(self._file.map, np.uint8, self.n_bytes, self.data_offset)
        rows = [int(n) for n in reversed(self.shape)]
        element = _ELEMENTS.get(self.tensor_type.name)
        if element is not None:
            return raw.view(element).reshape(rows)
        return raw.reshape(*rows[:-1], rows[-1] // block * size)


class GGUFHeader:
    """The fields ({key: value}: str, int, float, bool, or a list of them) and `tensors` of a GGUF
    file, and `map`, the file mapped read-only (the tensors' data are views of it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with self.path.open("rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._at = 0
        if self.map[:4] != b"GGUF":
            raise ValueError(f"{self.path.name} is not a GGUF file (it does not start with 'GGUF')")
        version, tensor_count, field_count = struct.unpack_from("<IQQ", self.map, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path.name}: GGUF version {version} is not read here; versions 2 and 3 are")
        self._at = 24
        self.fields: dict[str, Any] = {}
        try:
            for _ in range(field_count):
                key = self._string()
                self.fields[key] = self._value(self._scalar("<I"))
            table = [self._tensor_entry() for _ in range(tensor_count)]
        except (struct.error, ValueError, OverflowError) as e:
            raise ValueError(
                f"{self.path.name}: the GGUF header is cut short or damaged at byte {self._at} ({e})"
            ) from None
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *entry) for entry in table]

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.map, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        if self._at + length > len(self.map):
            raise ValueError(f"a string of {length} bytes runs past the end of the file")
        text = self.map[self._at : self._at + length].decode("utf-8", errors="replace")
        self._at += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("<I"), self._scalar("<Q")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            if item not in _SCALARS:
                raise ValueError(f"unknown GGUF value type {item} in an array")
            dtype = np.dtype(_SCALARS[item][1])
            values = np.frombuffer(self.map, dtype, count, self._at).tolist()
            self._at += dtype.itemsize * count
            return values
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._scalar(_SCALARS[kind][0])

    def _tensor_entry(self) -> tuple:
        name = self._string()
        dims = tuple(self._scalar("<Q") for _ in range(self._scalar("<I")))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, start: int, name: str, dims: tuple, kind: int, offset: int) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        tensor_type = GGMLQuantizationType(kind)
        block, size = GGML_QUANT_SIZES[tensor_type]
        elements = int(np.prod(dims)) if dims else 1
        return TensorInfo(name, dims, tensor_type, start + offset, elements, elements // block * size, self)
