"""The prefix cache's second tier: where blocks evicted from the device pool
go, so that a later hit copies them back instead of recomputing.

- ``MemoryTier``: host memory (numpy arrays); what GPU backends want.
- ``FileTier``: one file per block under a folder; it outlives the engine,
  so a system prompt cached yesterday is a hit today.

Both are bounded (in blocks) and drop their least recently used block.
A block's data is one float32 array ``[num_layers, 2 (k, v), num_kv_heads,
block_size, head_dim]``.

File format (little-endian)::

    magic        8 bytes   b"FDXKVBLK"
    version      uint32    FORMAT_VERSION
    header_len   uint32
    header       JSON, utf-8: fingerprint (model and layout), key, parent,
                 tokens, extra, dtype, shape, payload_bytes, payload_blake2b
    payload      the array's bytes

A file is loaded only when its magic, version, fingerprint, key (recomputed
from parent, tokens and extra), size and payload checksum all agree;
anything else is ignored with a warning and never read as KV.
"""
from __future__ import annotations

import abc
import hashlib
import json
import logging
import os
import struct
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

log = logging.getLogger("fdx.cache.swap")

MAGIC = b"FDXKVBLK"
FORMAT_VERSION = 1
SUFFIX = ".kvb"
ROOT_KEY = b""                 # the parent of a request's first block


def block_key(parent: bytes, tokens: Sequence[int], extra: Sequence[str] = ()) -> bytes:
    """The chained key of a full block: a hash of its parent's key, its
    token ids and extra keys (a cache salt). Stable across processes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())
    for e in extra:
        b = e.encode()
        h.update(len(b).to_bytes(4, "little") + b)
    return h.digest()


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """What a cached block holds: enough to confirm a hit token by token."""
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    extra: tuple[str, ...] = ()


class HostTier(abc.ABC):
    def __init__(self, max_blocks: int):
        self.max_blocks = max_blocks

    @abc.abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def get(self, meta: BlockMeta) -> np.ndarray | None:
        """The block's data if the tier holds ``meta.key`` with exactly these
        parent, tokens and extra keys; else None."""

    @abc.abstractmethod
    def put(self, meta: BlockMeta, data: np.ndarray) -> None:
        """Store a block (a no-op, bar recency, if it is already there)."""


class MemoryTier(HostTier):
    def __init__(self, max_blocks: int):
        super().__init__(max_blocks)
        self.blocks: OrderedDict[bytes, tuple[BlockMeta, np.ndarray]] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, meta: BlockMeta) -> np.ndarray | None:
        entry = self.blocks.get(meta.key)
        if entry is None or entry[0] != meta:
            return None
        self.blocks.move_to_end(meta.key)
        return entry[1]

    def put(self, meta: BlockMeta, data: np.ndarray) -> None:
        if meta.key in self.blocks:
            self.blocks.move_to_end(meta.key)
            return
        self.blocks[meta.key] = (meta, np.array(data, copy=True))
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


class FileTier(HostTier):
    """Blocks as files ``<key hex>.kvb`` under ``folder``. The index (key ->
    meta) is rebuilt at start from the headers, oldest file first."""

    def __init__(self, folder: str | os.PathLike, max_blocks: int, fingerprint: dict):
        super().__init__(max_blocks)
        self.folder = Path(folder)
        self.write_error: str | None = None      # set once a write failed: the tier stops writing
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)   # owner-only: KV is prompt content
        except OSError as e:
            self.write_error = e.strerror or type(e).__name__
            log.warning("prefix cache: cannot create %s (%s): going on without the file tier",
                        self.folder, self.write_error)
        self.fingerprint = fingerprint
        self.shape = [fingerprint["num_layers"], 2, fingerprint["num_kv_heads"],
                      fingerprint["block_size"], fingerprint["head_dim"]]
        self.payload_bytes = int(np.prod(self.shape)) * 4
        self.index: OrderedDict[bytes, BlockMeta] = OrderedDict()
        self.num_ignored = 0
        self._scan()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    # -- reading ------------------------------------------------------------
    def _scan(self) -> None:
        files = []
        for p in self.folder.glob("*" + SUFFIX):
            try:
                files.append((p.stat().st_mtime_ns, p))
            except OSError:
                continue
        for _, p in sorted(files):
            try:
                with open(p, "rb") as f:
                    meta, _ = self._read_header(f, p)
            except _Reject as e:
                self._ignore(p, str(e))
                continue
            except OSError as e:
                self._ignore(p, f"unreadable ({e.strerror})")
                continue
            self.index[meta.key] = meta
        while len(self.index) > self.max_blocks:
            self._drop_oldest()

    def _read_header(self, f, path: Path) -> tuple[BlockMeta, dict]:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise _Reject("not an fdx KV block file (bad magic)")
        version, header_len = struct.unpack("<II", head[8:])
        if version != FORMAT_VERSION:
            raise _Reject(f"format version {version}, expected {FORMAT_VERSION}")
        if header_len > 1 << 24:
            raise _Reject("header too large")
        try:
            header = json.loads(f.read(header_len).decode())
            fp = header["fingerprint"]
            if not isinstance(fp, dict):
                raise TypeError("fingerprint")
            meta = BlockMeta(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]),
                             tuple(int(t) for t in header["tokens"]),
                             tuple(str(e) for e in header.get("extra", ())))
            shape, dtype = list(header["shape"]), header["dtype"]
            int(header["payload_bytes"]), bytes.fromhex(header["payload_blake2b"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise _Reject(f"corrupt header ({type(e).__name__})") from None
        if fp != self.fingerprint:
            diff = sorted(k for k in set(fp) | set(self.fingerprint) if fp.get(k) != self.fingerprint.get(k))
            raise _Reject(f"written for another model or layout (differs in: {', '.join(diff)})")
        if shape != self.shape or dtype != "float32" or header["payload_bytes"] != self.payload_bytes:
            raise _Reject("payload shape does not match the fingerprint")
        if len(meta.tokens) != self.shape[3] or block_key(meta.parent, meta.tokens, meta.extra) != meta.key:
            raise _Reject("key does not match its tokens")
        if path.name != meta.key.hex() + SUFFIX:
            raise _Reject("file name does not match its key")
        return meta, header

    def get(self, meta: BlockMeta) -> np.ndarray | None:
        if self.index.get(meta.key) != meta:
            return None
        p = self.path(meta.key)
        try:
            with open(p, "rb") as f:
                stored, header = self._read_header(f, p)
                payload = f.read(self.payload_bytes + 1)
            if stored != meta:
                raise _Reject("header changed since the folder was scanned")
            if len(payload) != self.payload_bytes:
                raise _Reject(f"payload is {len(payload)} bytes, expected {self.payload_bytes}")
            if hashlib.blake2b(payload, digest_size=16).hexdigest() != header["payload_blake2b"]:
                raise _Reject("payload checksum mismatch")
        except _Reject as e:
            self._ignore(p, str(e))
            self.index.pop(meta.key, None)
            return None
        except OSError as e:
            self._ignore(p, f"unreadable ({e.strerror})")
            self.index.pop(meta.key, None)
            return None
        self.index.move_to_end(meta.key)
        try:
            os.utime(p)           # recency survives a restart
        except OSError:
            pass
        return np.frombuffer(payload, dtype=np.float32).reshape(self.shape)

    # -- writing ------------------------------------------------------------
    def put(self, meta: BlockMeta, data: np.ndarray) -> None:
        if meta.key in self.index:
            self.index.move_to_end(meta.key)
            return
        if self.write_error is not None:        # disk full or read-only: said once, go on without
            return
        payload = np.ascontiguousarray(data, dtype=np.float32).tobytes()
        assert len(payload) == self.payload_bytes, (len(payload), self.payload_bytes)
        header = json.dumps({
            "fingerprint": self.fingerprint, "key": meta.key.hex(), "parent": meta.parent.hex(),
            "tokens": list(meta.tokens), "extra": list(meta.extra), "dtype": "float32",
            "shape": self.shape, "payload_bytes": len(payload),
            "payload_blake2b": hashlib.blake2b(payload, digest_size=16).hexdigest(),
        }).encode()
        p = self.path(meta.key)
        tmp = p.with_name(p.name + f".tmp{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)    # owner-only
            with open(fd, "wb") as f:
                f.write(MAGIC + struct.pack("<II", FORMAT_VERSION, len(header)) + header + payload)
            os.replace(tmp, p)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.write_error = e.strerror or type(e).__name__
            log.warning("prefix cache: cannot write to %s (%s): going on without saving blocks to the "
                        "file tier (blocks already there are still read)", self.folder, self.write_error)
            return
        self.index[meta.key] = meta
        while len(self.index) > self.max_blocks:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        key, _ = self.index.popitem(last=False)
        self.path(key).unlink(missing_ok=True)

    def _ignore(self, path: Path, why: str) -> None:
        self.num_ignored += 1
        log.warning("prefix cache: ignoring %s: %s", path, why)


class _Reject(Exception):
    """A file that must not be loaded as KV."""


def model_fingerprint(model_id: str) -> dict:
    """Identify the weights by path, size and modification time of the
    model file (or of the weight and config files of a model folder)."""
    out: dict = {"model": model_id}
    p = Path(model_id) if model_id else None
    if p is not None and p.exists():
        files = [p] if p.is_file() else sorted(
            f for f in p.iterdir() if f.suffix in (".safetensors", ".gguf", ".json") and f.is_file())
        out["files"] = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return out
