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
    mac          32 bytes  HMAC-SHA256 under the tier key over a domain tag,
                           the 16 bytes above, the header and the payload
    header       JSON, utf-8: fingerprint (model and layout), key, parent,
                 tokens, extra, dtype, shape, payload_bytes
    payload      the array's bytes

A file is loaded only when its magic, version, fingerprint, key (recomputed
from parent, tokens and extra), size and MAC all agree; anything else is
ignored with a warning and never read as KV.

Whoever can write to the folder must not steer the engine (docs/security.md):
the folder is one fdx created 0700, or one owned by this user that no one
else can write to (else a ConfigError); files are opened without following
symlinks and without blocking (a FIFO is skipped), and only regular files are
read; temporary files are created exclusively (``O_EXCL | O_NOFOLLOW``,
0600) under a random name. The tier key (32 random bytes, the file
``KEY_FILE`` in the folder, 0600, made at first use) authenticates each
file, so a file forged with a recomputed checksum, or copied from another
tier folder, is a miss.
"""
from __future__ import annotations

import abc
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field

from fdx.core.config import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVConnector
from fdx.plugins.cache.blocks import BlockMeta, block_key, block_metas

log = logging.getLogger("fdx.cache.swap")
DIR_KEY = "config key 'plugins.connector.swap.dir'"

MAGIC = b"FDXKVBLK"
FORMAT_VERSION = 2
SUFFIX = ".kvb"
KEY_FILE = "tier.key"
KEY_BYTES = 32
MAC_DOMAIN = b"fdx kv tier block v2\0"
MAC_BYTES = 32
PREFIX_BYTES = 16 + MAC_BYTES

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
        self.fingerprint = fingerprint
        self.shape = [fingerprint["num_layers"], 2, fingerprint["num_kv_heads"],
                      fingerprint["block_size"], fingerprint["head_dim"]]
        self.payload_bytes = int(np.prod(self.shape)) * 4
        self.index: OrderedDict[bytes, BlockMeta] = OrderedDict()
        self.num_ignored = 0
        self.key: bytes | None = None
        try:
            self.folder.mkdir(mode=0o700, parents=True)   # owner-only: KV is prompt content
        except FileExistsError:
            check_folder(self.folder)
        except OSError as e:
            self.write_error = e.strerror or type(e).__name__
            log.warning("prefix cache: cannot create %s (%s): going on without the file tier",
                        self.folder, self.write_error)
            return
        try:
            self.key = tier_key(self.folder)
        except OSError as e:
            self.write_error = e.strerror or type(e).__name__
            log.warning("prefix cache: cannot read or make the tier key in %s (%s): going on without "
                        "the file tier", self.folder, self.write_error)
            return
        self._scan()

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _mac(self, prefix: bytes, header: bytes, payload: bytes) -> bytes:
        return hmac.new(self.key, MAC_DOMAIN + prefix + header + payload, hashlib.sha256).digest()

    # -- reading ------------------------------------------------------------
    def _scan(self) -> None:
        files = []
        for p in self.folder.glob("*" + SUFFIX):
            try:
                st = p.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                self._ignore(p, "not a regular file")
                continue
            files.append((st.st_mtime_ns, p))
        for _, p in sorted(files):
            try:
                with open_regular(p) as f:
                    meta, _, _ = self._read_header(f, p)
            except _Reject as e:
                self._ignore(p, str(e))
                continue
            except OSError as e:
                self._ignore(p, f"unreadable ({e.strerror})")
                continue
            self.index[meta.key] = meta
        while len(self.index) > self.max_blocks:
            self._drop_oldest()

    def _read_header(self, f, path: Path) -> tuple[BlockMeta, bytes, bytes]:
        """The file's meta, its first 16 bytes and header (for the MAC);
        the file is left at its MAC."""
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise _Reject("not an fdx KV block file (bad magic)")
        version, header_len = struct.unpack("<II", head[8:])
        if version != FORMAT_VERSION:
            raise _Reject(f"format version {version}, expected {FORMAT_VERSION}")
        if header_len > 1 << 24:
            raise _Reject("header too large")
        f.seek(PREFIX_BYTES)
        raw = f.read(header_len)
        try:
            header = json.loads(raw.decode())
            fp = header["fingerprint"]
            if not isinstance(fp, dict):
                raise TypeError("fingerprint")
            meta = BlockMeta(bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]),
                             tuple(int(t) for t in header["tokens"]),
                             tuple(str(e) for e in header.get("extra", ())))
            shape, dtype = list(header["shape"]), header["dtype"]
            int(header["payload_bytes"])
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
        f.seek(16)
        return meta, head, raw

    def get(self, meta: BlockMeta) -> np.ndarray | None:
        if self.index.get(meta.key) != meta:
            return None
        p = self.path(meta.key)
        try:
            with open_regular(p) as f:
                stored, head, header = self._read_header(f, p)
                mac = f.read(MAC_BYTES)
                f.seek(PREFIX_BYTES + len(header))
                payload = f.read(self.payload_bytes + 1)
                try:
                    os.utime(f.fileno())           # recency survives a restart
                except OSError:
                    pass
            if stored != meta:
                raise _Reject("header changed since the folder was scanned")
            if len(payload) != self.payload_bytes:
                raise _Reject(f"payload is {len(payload)} bytes, expected {self.payload_bytes}")
            if not hmac.compare_digest(mac, self._mac(head, header, payload)):
                raise _Reject("checksum (HMAC) mismatch: corrupted, forged, or written under "
                              "another tier key")
        except _Reject as e:
            self._ignore(p, str(e))
            self.index.pop(meta.key, None)
            return None
        except OSError as e:
            self._ignore(p, f"unreadable ({e.strerror})")
            self.index.pop(meta.key, None)
            return None
        self.index.move_to_end(meta.key)
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
        }).encode()
        head = MAGIC + struct.pack("<II", FORMAT_VERSION, len(header))
        p = self.path(meta.key)
        tmp = p.with_name(f"{p.name}.tmp{os.getpid()}-{secrets.token_hex(8)}")
        try:
            # a new file, never an existing one or a symlink's target; owner-only
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                f.write(head + self._mac(head, header, payload) + header + payload)
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


def check_folder(folder: Path) -> None:
    """An existing tier folder must be a directory of this user that no one
    else can write to: whoever can plant files there could steer the engine."""
    st = folder.stat()
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    if problem:
        raise ConfigError(f"{DIR_KEY}: {folder} {problem}; use a folder only this user can "
                          f"write to (fdx creates a missing one with mode 0700)")


def open_regular(path: Path):
    """``path`` opened for reading if it is a regular file: a symlink is not
    followed and a FIFO or device does not block (``OSError`` / ``_Reject``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Reject("not a regular file")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def tier_key(folder: Path) -> bytes:
    """The folder's tier key: read from ``KEY_FILE``, or made (random, 0600)
    if there is none. A key file that is not this user's private regular
    file is a ConfigError."""
    path = folder / KEY_FILE
    key = secrets.token_bytes(KEY_BYTES)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        with open(fd, "wb") as f:
            f.write(key)
        return key
    try:
        with open_regular(path) as f:
            st = os.fstat(f.fileno())
            key = f.read(KEY_BYTES + 1)
    except (_Reject, OSError) as e:
        raise ConfigError(f"{DIR_KEY}: the tier key {path} is not a readable regular file ({e})") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or len(key) != KEY_BYTES:
        raise ConfigError(f"{DIR_KEY}: the tier key {path} must be this user's {KEY_BYTES}-byte "
                          f"file with mode 0600 (remove it to have fdx make a new one)")
    return key


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


# =============================================================================
# The connector: the second tier on the KV connector seam
# =============================================================================

DEFAULT_SWAP_BLOCKS = 1024      # tier size when dir is set and max_blocks is not


@dataclass(slots=True)
class SwapSettings:
    """``plugins.connector.swap`` (docs/configuration.md "Prefix cache and its second tier")."""
    dir: str | None = None                     # the tier as files in this folder (outlive restarts);
                                               # None: in host memory
    max_blocks: Annotated[int, Field(ge=0)] | None = None   # tier size in blocks; None: 1024 with dir,
                                               # else 0 (off)


@dataclass(slots=True)
class SwapStep:
    """The runner side's work for one step (plain data)."""
    loads: list[tuple[int, BlockMeta, np.ndarray | None]]   # (block id, what to load, its data if read)
    saves: list[tuple[str, list[tuple[int, BlockMeta]]]]    # (request id, its full blocks to save)


class SwapConnector(KVConnector):
    """A second tier for KV blocks: host memory (``MemoryTier``), or files
    under ``plugins.connector.swap.dir`` (``FileTier``) that outlive the
    engine, sized by ``max_blocks`` (default 1024 with dir): ``SwapSettings``.

    - Saving is write-through at the end of a request: its full computed
      blocks that the tier lacks are copied out by the runner side in the
      next step, while the scheduler keeps the blocks (``request_finished``
      returns True); then they are freed. Blocks the tier has are not
      copied again.
    - Loading: for a waiting request, the blocks after its local prefix hit
      that the tier holds (same chained keys, tokens confirmed, file
      checksums verified: read at lookup and kept until admission) are
      counted as matched; after allocation, the runner side copies them into the
      new blocks before the forward, and the prefix cache (if any)
      registers them like computed blocks.
    - ``close()`` (engine shutdown) performs the saves still pending.
    """

    Settings = SwapSettings

    def __init__(self, settings: SwapSettings | None = None, context=None):
        super().__init__(settings if settings is not None else SwapSettings(), context)
        size = self.settings.max_blocks
        if size is None:
            size = DEFAULT_SWAP_BLOCKS if self.settings.dir else 0
        self.max_blocks = size
        self.tier: HostTier | None = None if self.settings.dir else MemoryTier(size)
        self.memo: dict[str, list[bytes]] = {}
        self.pending_loads: list[tuple[int, BlockMeta, np.ndarray | None]] = []
        self.staged: dict[str, tuple[int, list[np.ndarray]]] = {}   # request -> (first block, data read)
        self.pending_saves: list[tuple[str, list[tuple[int, BlockMeta]]]] = []
        self.saved: set[str] = set()
        self.kv_caches: list | None = None
        self.counters = {"swap_loaded_blocks": 0, "swap_saved_blocks": 0}

    # -- scheduler side ----------------------------------------------------------
    def _metas(self, request, stop: int, start: int = 0):
        return block_metas(request, self.block_size, stop, start, self.memo.setdefault(request.request_id, []))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Blocks are read (and checked: a corrupt file is a miss) here, and
        kept until the request is admitted, so a load cannot fail later."""
        if self.tier is None or not self.max_blocks:
            return 0
        first = num_computed_tokens // self.block_size
        staged = self.staged.get(request.request_id)
        if staged is not None and staged[0] == first:
            return len(staged[1]) * self.block_size
        data = []
        for _, meta in self._metas(request, (request.num_tokens - 1) // self.block_size, first):
            if meta.key not in self.tier:
                break
            block = self.tier.get(meta)
            if block is None:
                break
            data.append(block)
        self.staged = {request.request_id: (first, data)}          # only the request being admitted
        return len(data) * self.block_size

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size      # the local hit's blocks
        n = num_external_tokens // self.block_size
        _, data = self.staged.pop(request.request_id, (start, []))
        for k, (i, meta) in enumerate(self._metas(request, start + n, start)):
            self.pending_loads.append((block_ids[i], meta, data[k] if k < len(data) else None))

    def request_finished(self, request, block_ids: list[int]) -> bool:
        self.memo.pop(request.request_id, None)
        self.staged.pop(request.request_id, None)
        if self.tier is None or not self.max_blocks:
            return False
        full = min(request.num_computed_tokens // self.block_size, len(block_ids))
        todo = [(block_ids[i], meta) for i, meta in block_metas(request, self.block_size, full)
                if meta.key not in self.tier]
        if not todo:
            return False
        self.pending_saves.append((request.request_id, todo))
        return True

    def build_connector_meta(self) -> SwapStep:
        step = SwapStep(self.pending_loads, self.pending_saves)
        self.pending_loads, self.pending_saves = [], []
        return step

    # -- runner side ----------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layout) -> None:
        self.kv_caches, self.spec = kv_caches, layout
        self.num_kv_heads, self.num_slots, self.head_dim = layout.num_kv_heads, layout.num_slots, layout.head_dim
        folder = self.settings.dir
        if folder and self.max_blocks:
            fingerprint = {**model_fingerprint(cc_model(self.config)), "num_layers": layout.num_layers,
                           "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim,
                           "block_size": layout.block_size, "dtype": "float32",
                           "layout": "head-major rows h*num_slots+slot"}
            self.tier = FileTier(folder, self.max_blocks, fingerprint)

    def _rows(self, block_id: int):
        import paddle
        base = block_id * self.block_size       # rows [num_kv_heads, block_size], whatever the layout
        return paddle.to_tensor(self.spec.kv_rows(np.arange(base, base + self.block_size)).reshape(-1))

    def read_block(self, block_id: int) -> np.ndarray:
        """The block's KV: [num_layers, 2, num_kv_heads, block_size, head_dim], float32."""
        import paddle
        idx = self._rows(block_id)
        parts = [paddle.gather(self.spec.row_view(t), idx) for kv in self.kv_caches for t in kv]
        shape = [len(self.kv_caches), 2, self.num_kv_heads, self.block_size, self.head_dim]
        return paddle.stack(parts).astype("float32").numpy().reshape(shape)

    def write_block(self, block_id: int, data: np.ndarray) -> None:
        import paddle
        idx = self._rows(block_id)
        flat = data.reshape(len(self.kv_caches), 2, self.num_kv_heads * self.block_size, self.head_dim)
        for layer, kv in enumerate(self.kv_caches):
            for j, t in enumerate(kv):
                src = paddle.to_tensor(np.ascontiguousarray(flat[layer, j])).astype(t.dtype)
                self.spec.row_view(t).scatter_(idx, src, overwrite=True)

    def start_load_kv(self, metadata: SwapStep | None) -> None:
        if metadata is None or self.tier is None:
            return
        for rid, blocks in metadata.saves:
            for block_id, meta in blocks:
                self.tier.put(meta, self.read_block(block_id))
                self.counters["swap_saved_blocks"] += 1
            self.saved.add(rid)
        for block_id, meta, data in metadata.loads:
            if data is None:
                data = self.tier.get(meta)
            if data is None:       # cannot happen: lookups read and keep the data they match
                raise RuntimeError(f"swap tier: block {meta.key.hex()} vanished between lookup and load")
            self.write_block(block_id, data)
            self.counters["swap_loaded_blocks"] += 1

    def get_finished(self) -> tuple[set[str], set[str]]:
        done, self.saved = self.saved, set()
        return done, set()

    def stats(self) -> dict[str, float]:
        return {**self.counters, "swap_blocks": len(self.tier) if self.tier is not None else 0,
                "swap_ignored_files": getattr(self.tier, "num_ignored", 0)}

    def close(self) -> None:
        if self.kv_caches is None:
            return
        try:
            self.start_load_kv(SwapStep([], self.pending_saves))
            self.pending_saves = []
        finally:
            self.kv_caches = None


def cc_model(config) -> str:
    """What names the weights in the fingerprint (the model path, or the embedded default)."""
    model = config.model.model
    if model is None:
        from fdx.model_io.loader import default_model_path
        model = default_model_path()
    return str(model)


@hookimpl
def fdx_register_connectors(register):
    register("swap", SwapConnector)
