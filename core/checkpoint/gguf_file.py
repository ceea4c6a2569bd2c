"""Reading a GGUF file's metadata and tensor index, checked: the one
reader the weight loader and the GGUF tokenizer share (so neither imports
the other)."""
from __future__ import annotations

import threading

import numpy as np

_memmap_lock = threading.Lock()


def read_gguf(path):
    """Parse a GGUF file from memory rather than a memmap: GGUFReader walks
    the vocabulary element by element, and numpy.memmap's per-slice
    overhead made that 3-4x slower (7 s against 2 s for SmolLM2).

    A file that is not GGUF, truncated or corrupt raises a ValueError that
    names the file and what is wrong."""
    import gguf

    class _Truncated(Exception):
        pass

    class CheckedReader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            end = 0                               # where the last tensor's data ends
            for field in fields:
                dims, raw_dtype, offset = field.parts[3], field.parts[4], field.parts[5]
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                end = max(end, start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block)
            if end > len(self.data):
                raise _Truncated(end)
            super()._build_tensors(start_offs, fields)

    data = np.fromfile(str(path), dtype=np.uint8)
    if data[:4].tobytes() != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes "
                         f"(it starts with {data[:4].tobytes()!r}, {data.size} bytes in all)")
    with _memmap_lock:
        saved = np.memmap
        np.memmap = lambda *a, **k: data  # GGUFReader.__init__ calls np.memmap(path, mode=...)
        try:
            reader = CheckedReader(str(path))
        except _Truncated as e:
            raise ValueError(f"{path} is truncated: its tensors need {e.args[0]} bytes but the file has "
                             f"{data.size}") from None
        except Exception as e:
            raise ValueError(f"{path} is truncated or corrupt: reading its GGUF metadata and tensor index failed "
                             f"({data.size} bytes; {type(e).__name__}: {e})") from None
        finally:
            np.memmap = saved
    return reader
