"""A GGUF file's metadata and tensor table, parsed over a memory map, and its tensors dequantized.

``gguf.GGUFReader`` turns every element of every metadata array into its own numpy view:
on a 49k-token vocabulary that alone takes about 2 s. This reader walks the header with
``struct`` and keeps string arrays (vocabulary, merges) as their length only, so opening
a file costs milliseconds; the format's constants and the dequantization come from ``gguf``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import gguf
import numpy as np

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b", gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h", gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i", gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q", gguf.GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists the fastest-moving dimension first
    ggml_type: gguf.GGMLQuantizationType
    offset: int  # from the start of the file
    nbytes: int


class GGUFFile:
    """An open GGUF file (little-endian, version 2 or 3).

    ``metadata`` maps keys to values; an array of strings is kept as its length only.
    ``tensors`` maps names to ``TensorInfo``, in file order. Raises ValueError for a file
    that is not GGUF, is cut short (an incomplete download), or holds a tensor type ``gguf``
    cannot size.
    """

    def __init__(self, path: Path) -> None:
        with open(path, "rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            table = self._header(path)
        except struct.error:
            raise ValueError(f"{path} is truncated: it ends ({len(self._map)} bytes) inside its GGUF header "
                             "(an incomplete download?)") from None
        alignment = self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = {name: TensorInfo(name, shape, kind, data_start + offset, _nbytes(name, shape, kind))
                        for name, shape, kind, offset in table}
        end = max((info.offset + info.nbytes for info in self.tensors.values()), default=0)
        if end > len(self._map):
            raise ValueError(f"{path} is truncated: its tensors take {end} bytes, the file has {len(self._map)} "
                             "(an incomplete download?)")

    def _header(self, path: Path) -> list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]]:
        """Read the metadata into ``self.metadata``; return the tensor table's entries."""
        magic, version, tensor_count, kv_count = self._unpack("<IIQQ")
        if magic != gguf.GGUF_MAGIC or version not in (2, 3):
            raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(gguf.GGUFValueType(self._unpack("<I")[0]))
        return [self._tensor_entry() for _ in range(tensor_count)]

    def blocks(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes, a read-only view of the map: ``[*shape[:-1], bytes per row]`` uint8."""
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[info.ggml_type]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return raw.reshape(*info.shape[:-1], info.shape[-1] // block_size * block_bytes)

    def dequantize(self, info: TensorInfo) -> np.ndarray:
        """The tensor as a new, writable float32 array of shape ``info.shape``."""
        raw = self.blocks(info)
        try:
            values = dequantize_blocks(raw, info.ggml_type)
        except NotImplementedError as error:
            raise ValueError(f"cannot dequantize {info.name} ({info.ggml_type.name}): {error}") from error
        return values if values.flags.writeable else values.copy()  # F32 comes back as a view of the map

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        self._pos += length
        return self._map[self._pos - length:self._pos].decode("utf-8")

    def _value(self, kind: gguf.GGUFValueType) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self._string()
        if kind != gguf.GGUFValueType.ARRAY:
            return self._unpack(_SCALAR_FORMATS[kind])[0]
        item_kind, count = self._unpack("<IQ")
        item_kind = gguf.GGUFValueType(item_kind)
        if item_kind == gguf.GGUFValueType.STRING:
            for _ in range(count):  # variable-length items: walk past them
                (length,) = self._unpack("<Q")
                self._pos += length
            return count
        return list(self._unpack(f"<{count}{_SCALAR_FORMATS[item_kind][1]}"))

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{num_dims}Q")
        kind, offset = self._unpack("<IQ")
        try:
            ggml_type = gguf.GGMLQuantizationType(kind)
        except ValueError:
            known = ", ".join(t.name for t in gguf.GGMLQuantizationType)
            raise ValueError(f"tensor {name} has ggml type {kind}, which the gguf package does not know "
                             f"(a newer llama.cpp format?); known: {known}") from None
        return name, tuple(reversed(dims)), ggml_type, offset


def dequantize_blocks(blocks: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Blocks ``[..., row bytes]`` of ``ggml_type`` as float32 values ``[..., row length]``: gguf's
    dequantization, and llama.cpp's Q1_0, which gguf sizes but cannot dequantize (a float16 scale d
    per 128 weights, then one bit a weight, least significant first: +d if set, else -d).
    Raises NotImplementedError for a type neither knows."""
    if ggml_type != gguf.GGMLQuantizationType.Q1_0:
        return gguf.quants.dequantize(blocks, ggml_type)
    raw = np.asarray(blocks).reshape(*blocks.shape[:-1], -1, gguf.GGML_QUANT_SIZES[ggml_type][1])
    scales = raw[..., :2].copy().view(np.float16).astype(np.float32)
    signs = np.unpackbits(raw[..., 2:], axis=-1, bitorder="little").astype(np.float32) * 2.0 - 1.0
    return (signs * scales).reshape(*blocks.shape[:-1], -1)


def _nbytes(name: str, shape: tuple[int, ...], kind: gguf.GGMLQuantizationType) -> int:
    if kind not in gguf.GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name} has ggml type {kind.name}, which gguf cannot size")
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    return prod(shape) // block_size * block_bytes
