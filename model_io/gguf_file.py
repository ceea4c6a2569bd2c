"""Reading a GGUF file, checked: the one reader the weight loader and the
GGUF tokenizer share (so neither imports the other).

Two ways in. ``read_gguf`` is the ``gguf`` package's GGUFReader over the
whole file, every field parsed (the tokenizer's vocabulary and merges), the
tensors' bytes left in the file (memmap views).
``read_gguf_index`` reads only what a model load needs: the scalar and
string metadata, the length of each array and the tensor index, skipping
the bytes of the tokenizer's arrays; ``GgufIndex.read`` then reads one
tensor's bytes at a time. The serving engine loads its weights through the
index: parsing SmolLM2's 49,152 tokens and 48,900 merges into numpy views
took 74 MB for a moment and left about 13 MB of glibc's heap resident.

A file that is not GGUF, truncated or corrupt raises a ValueError that
names the file and what is wrong, the same words from either reader.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = ["GGML_TYPES", "GGUF_TOKENIZER_MODELS", "GgufIndex", "GgufTensor", "read_gguf", "read_gguf_index"]

# tokenizer.ggml.model values fdx builds a tokenizer for (model_io/tokenizer.py)
GGUF_TOKENIZER_MODELS = ("gpt2", "llama")

_memmap_lock = threading.Lock()

# GGML tensor types: id -> (name, elements per block, bytes per block), as
# ggml.h numbers them (the ``gguf`` package's GGML_QUANT_SIZES; a test
# compares the two). Kept here so reading an index imports no ``gguf``.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66), 39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}

# GGUF metadata value types: id -> struct format (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# arrays whose elements an index skips (their length is kept): the tokenizer's
_SKIPPED_PREFIX = "tokenizer.ggml."


class _Truncated(Exception):
    pass


def _check_magic(path, head: bytes, size: int) -> None:
    if head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes "
                         f"(it starts with {head[:4]!r}, {size} bytes in all)")


def _wrap(path, size: int, e: Exception) -> ValueError:
    if isinstance(e, _Truncated):
        return ValueError(f"{path} is truncated: its tensors need {e.args[0]} bytes but the file has {size}")
    return ValueError(f"{path} is truncated or corrupt: reading its GGUF metadata and tensor index failed "
                      f"({size} bytes; {type(e).__name__}: {e})")


def read_gguf(path):
    """The ``gguf`` package's GGUFReader over ``path``. Its metadata and
    tensor index are parsed from memory rather than a memmap (GGUFReader
    walks the vocabulary element by element, and numpy.memmap's per-slice
    overhead made that 3-4x slower: 7 s against 2 s for SmolLM2); only
    those bytes are read: the tensors' data are views of a read-only
    memmap of the file, read if and when used (the tokenizer never does,
    and reading the whole file made a 1.1 GB model's load peak 1.1 GB
    higher). Checked first by ``read_gguf_index``, so a bad file raises the
    same ValueError from either reader."""
    import gguf

    index = read_gguf_index(path)
    real_memmap = np.memmap

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            self.data = real_memmap(str(path), mode="r")   # the tensors' bytes: views, read when used
            super()._build_tensors(start_offs, fields)

    head = np.fromfile(str(path), dtype=np.uint8, count=index.data_offset)
    with _memmap_lock:
        np.memmap = lambda *a, **k: head  # GGUFReader.__init__ calls np.memmap(path, mode=...)
        try:
            reader = CheckedReader(str(path))
        except Exception as e:
            raise _wrap(path, Path(path).stat().st_size, e) from None
        finally:
            np.memmap = real_memmap
    return reader


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One entry of a GGUF file's tensor index. ``dims`` as the file lists
    them (innermost first: a linear weight is ``(in, out)``); ``offset``
    from the start of the file."""
    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The GGML type's name: ``F32``, ``Q4_1``, ``Q6_K``, ..."""
        return GGML_TYPES[self.type_id][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy order (outermost first): ``(out, in)`` for a linear weight."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True, slots=True)
class GgufIndex:
    """A GGUF file's metadata and tensor index, without its tensor data.

    ``fields``: every metadata key with its value as Python (str, int,
    float, bool, a list for an array), except the ``tokenizer.ggml.*``
    arrays (the vocabulary, scores, token types, merges), whose elements
    were skipped. ``array_lengths``: the length of every array field, the
    skipped ones too."""
    path: str
    version: int
    fields: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[GgufTensor, ...]
    data_offset: int

    def read(self, tensor: GgufTensor, f: BinaryIO | None = None) -> np.ndarray:
        """The tensor's bytes, a fresh uint8 array ``[rows, row_bytes]``
        (rows: every dimension but the innermost). ``f``: the file, open,
        to read many tensors through one handle."""
        if f is None:
            with open(self.path, "rb") as f:
                return self.read(tensor, f)
        out = np.empty(tensor.nbytes, dtype=np.uint8)
        f.seek(tensor.offset)
        if f.readinto(memoryview(out)) != tensor.nbytes:
            raise ValueError(f"{self.path} is truncated: reading the tensor {tensor.name} ended early")
        rows = int(np.prod(tensor.dims[1:], dtype=np.int64)) if len(tensor.dims) > 1 else 1
        return out.reshape(rows, -1)


class _Cursor:
    """Little-endian reads from a binary file, a buffered one."""

    def __init__(self, f: BinaryIO, size: int):
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError(f"the metadata ends at byte {self.f.tell()}, inside a value of {n} bytes")
        return b

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def length(self) -> int:
        n = self.scalar("Q")
        if n > self.size - self.f.tell():
            raise ValueError(f"a length of {n} at byte {self.f.tell() - 8} runs past the end of the file")
        return n

    def string(self) -> str:
        return self.take(self.length()).decode("utf-8")

    def skip_string(self) -> None:
        self.f.seek(self.length(), 1)

    def value(self, vtype: int, skip: bool = False) -> tuple[Any, int | None]:
        """(the value, its length if it is an array); a skipped array's value is None."""
        if vtype == _STRING:
            return self.string(), None
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype]), None
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, n = self.scalar("I"), self.scalar("Q")
        if etype == _STRING:
            if skip:
                for _ in range(n):
                    self.skip_string()
                return None, n
            return [self.string() for _ in range(n)], n
        if etype not in _SCALARS:
            raise ValueError(f"unknown GGUF array element type {etype}")
        fmt = _SCALARS[etype]
        nbytes = n * struct.calcsize(fmt)
        if nbytes > self.size - self.f.tell():
            raise ValueError(f"an array of {n} elements runs past the end of the file")
        if skip:
            self.f.seek(nbytes, 1)
            return None, n
        return list(struct.unpack(f"<{n}{fmt}", self.take(nbytes))), n


def read_gguf_index(path) -> GgufIndex:
    """``path``'s metadata and tensor index (see GgufIndex), checked as
    read_gguf checks it: the magic bytes, the version (2 or 3, little-endian),
    and that every tensor's data lies inside the file."""
    path = str(path)
    size = Path(path).stat().st_size
    with open(path, "rb") as f:
        _check_magic(path, f.read(4), size)
        try:
            return _read_index(path, _Cursor(f, size))
        except Exception as e:
            raise _wrap(path, size, e) from None


def _read_index(path: str, c: _Cursor) -> GgufIndex:
    version = c.scalar("I")
    if version not in _VERSIONS:
        order = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
        raise ValueError(f"GGUF version {version}{order}: fdx reads versions 2 and 3, little-endian")
    n_tensors, n_fields = c.scalar("Q"), c.scalar("Q")
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_fields):
        key = c.string()
        value, n = c.value(c.scalar("I"), skip=key.startswith(_SKIPPED_PREFIX))
        if n is not None:
            lengths[key] = n
        if value is not None or n is None:
            fields[key] = value
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("I")
        if n_dims > 8:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
        dims = struct.unpack(f"<{n_dims}Q", c.take(8 * n_dims))
        type_id, offset = c.scalar("I"), c.scalar("Q")
        if type_id not in GGML_TYPES:
            raise ValueError(f"tensor {name!r} has an unknown GGML type {type_id}")
        infos.append((name, dims, type_id, offset))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment is {alignment!r}: it must be a power of two")
    data_offset = -(-c.f.tell() // alignment) * alignment
    tensors, names, end = [], set(), 0
    for name, dims, type_id, offset in infos:
        if name in names:
            raise ValueError(f"the tensor {name!r} is listed twice")
        names.add(name)
        _, block, type_size = GGML_TYPES[type_id]
        n = int(np.prod(dims, dtype=np.int64))
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name!r}: {dims[0]} elements a row is not a whole number of blocks of {block}")
        t = GgufTensor(name, tuple(int(d) for d in dims), type_id, data_offset + offset, n // block * type_size)
        end = max(end, t.offset + t.nbytes)
        tensors.append(t)
    if end > c.size:
        raise _Truncated(end)
    return GgufIndex(path, version, fields, lengths, tuple(tensors), data_offset)
