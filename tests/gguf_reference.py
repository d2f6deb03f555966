"""A GGUF file for transformers' model loader to read as the reference, without its vocabulary.

``gguf.GGUFReader``, which that loader opens twice (for the config, then for the tensors), makes
numpy views of every element of every metadata array: for Gemma 3's 262k tokens, their scores
and types, tens of seconds, for nothing the model needs. ``without_vocabulary`` copies the file
byte for byte but for those arrays: every other key (hyperparameters, special token ids), the
tensor table and the tensor data are the original bytes."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
              "tokenizer.ggml.merges")
_SIZES = {gguf.GGUFValueType.UINT8: 1, gguf.GGUFValueType.INT8: 1, gguf.GGUFValueType.BOOL: 1,
          gguf.GGUFValueType.UINT16: 2, gguf.GGUFValueType.INT16: 2, gguf.GGUFValueType.UINT32: 4,
          gguf.GGUFValueType.INT32: 4, gguf.GGUFValueType.FLOAT32: 4, gguf.GGUFValueType.UINT64: 8,
          gguf.GGUFValueType.INT64: 8, gguf.GGUFValueType.FLOAT64: 8}


class _Cursor:
    def __init__(self, view: mmap.mmap) -> None:
        self.view, self.pos = view, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.view, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self.pos += length
        return self.view[self.pos - length:self.pos].decode("utf-8")

    def skip_value(self, kind: gguf.GGUFValueType) -> object:
        """Moves past a value of ``kind``; returns it when it is a scalar or a string."""
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind != gguf.GGUFValueType.ARRAY:
            start = self.pos
            self.pos += _SIZES[kind]
            return self.view[start:self.pos]
        item, count = self.unpack("<IQ")
        item = gguf.GGUFValueType(item)
        if item in _SIZES:
            self.pos += count * _SIZES[item]
        else:
            for _ in range(count):
                self.skip_value(item)
        return None


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


def without_vocabulary(source: Path, out: Path) -> Path:
    """Writes ``source`` without the ``VOCABULARY`` arrays to ``out``; where the file has no
    ``{arch}.vocab_size`` (transformers then counts the tokens), it gets the token embedding's
    rows as one. Returns ``out``."""
    with open(source, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(view)
    magic, version, tensor_count, kv_count = cursor.unpack("<IIQQ")
    assert magic == gguf.GGUF_MAGIC and version in (2, 3), f"{source} is not a little-endian GGUF v2/v3 file"
    kept, values = [], {}
    for _ in range(kv_count):
        start = cursor.pos
        key = cursor.string()
        values[key] = cursor.skip_value(gguf.GGUFValueType(cursor.unpack("<I")[0]))
        if key not in VOCABULARY:
            kept.append(view[start:cursor.pos])
    table_start, rows = cursor.pos, {}
    for _ in range(tensor_count):
        name = cursor.string()
        (num_dims,) = cursor.unpack("<I")
        rows[name] = cursor.unpack(f"<{num_dims}Q")[-1]  # ggml lists the fastest-moving dimension first
        cursor.unpack("<IQ")
    table = view[table_start:cursor.pos]
    alignment = struct.unpack("<I", values["general.alignment"])[0] if "general.alignment" in values \
        else gguf.GGUF_DEFAULT_ALIGNMENT
    data_start = -(-cursor.pos // alignment) * alignment
    vocab_key = f"{values['general.architecture']}.vocab_size"
    if vocab_key not in values:
        kept.append(_key(vocab_key) + struct.pack("<II", gguf.GGUFValueType.UINT32, rows["token_embd.weight"]))
    header = struct.pack("<IIQQ", magic, version, tensor_count, len(kept)) + b"".join(kept) + table
    with open(out, "wb") as file, memoryview(view) as data:
        file.write(header + bytes(-len(header) % alignment))
        file.write(data[data_start:])  # the tensors, unchanged: their offsets count from here
    view.close()
    return out
