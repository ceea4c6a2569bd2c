"""Facts about the host that several parts key on: where fdx caches what it
builds, which CPU this is, how many cores this process may use.

Plain Python (no Paddle): the compiled kernels (fdx.ops.cpp), the CPU
backend and ``fdx bench peers`` all read them from here.
"""
from __future__ import annotations

import os
import platform
import signal
from pathlib import Path
from typing import Callable

__all__ = ["cache_root", "cpu_id", "cpu_model", "cpu_flags", "available_cores", "portable_kernels", "PORTABLE_ENV"]

PORTABLE_ENV = "FDX_PORTABLE_KERNELS"


def cache_root() -> Path:
    """$FDX_CACHE_DIR, else $XDG_CACHE_HOME/fdx, else ~/.cache/fdx."""
    if root := os.environ.get("FDX_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fdx"


def _cpuinfo_lines() -> list[str] | None:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return None


def cpu_id() -> str:
    """Model and feature flags: what a -march=native build is keyed by (it
    must not run on another CPU)."""
    lines = _cpuinfo_lines()
    if lines is None:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model} {flags}"


def cpu_model() -> str:
    """The CPU's model name, for reports."""
    for line in _cpuinfo_lines() or ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def available_cores() -> int:
    """The cores this process may use (its affinity mask)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def cpu_flags() -> list[str]:
    """The CPU's feature flags (/proc/cpuinfo), empty where unknown."""
    for line in _cpuinfo_lines() or ():
        if line.startswith("flags"):
            return line.split(":", 1)[1].split()
    return []


def portable_kernels() -> bool:
    """FDX_PORTABLE_KERNELS=1: the portable path. No Paddle fused CPU kernel
    runs, and fdx's compiled kernels are built for the architecture's
    baseline instruction set instead of this CPU's (docs/backends.md)."""
    return os.environ.get(PORTABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def signal_name(status: int) -> str:
    """The name of the signal behind a negative child exit status
    (``-4`` -> ``SIGILL``); ``signal N`` for one Python does not name."""
    try:
        return signal.Signals(-status).name
    except ValueError:
        return f"signal {-status}"


def rss_bytes() -> int:
    """This process's resident set now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_free_heap() -> None:
    """Collect garbage, then hand the allocator's free pages back to the
    system (glibc's ``malloc_trim``; nothing elsewhere). A model load frees
    far more than it keeps (a GGUF file's copy and its metadata objects,
    about 170 MB for SmolLM2, against 97 MB of weights), and glibc keeps
    freed pages between live objects resident until asked."""
    import gc
    gc.collect()
    trim = malloc_trim()
    if trim is not None:
        trim(0)


_TRIM: list = []

MADV_PAGEOUT = 21      # Linux 5.4+: reclaim the range's pages now (include/uapi/asm-generic/mman-common.h)


def release_library_pages() -> int:
    """Ask the kernel to reclaim the clean pages of this process's shared
    libraries (their read-only file mappings: code and constants) and
    return the bytes the resident set lost. Importing Paddle touches about
    165 MiB of libpaddle's pages (static initializers, op registries) of
    which a served model uses about 20: the rest stay resident only because
    nothing else wanted the memory. They are the kernel's to drop under
    pressure anyway (clean, file-backed); a page still needed is read back
    on its next use. Pages another process maps too (a second engine, a
    test worker) are left alone by the kernel. 0 where there is no
    ``madvise(MADV_PAGEOUT)`` (other systems, kernels before 5.4)."""
    if platform.system() != "Linux":
        return 0
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    before = proc_kib_field("/proc/self/status", "RssFile")
    try:
        with open("/proc/self/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return 0
    for line in maps:
        fields = line.split(None, 5)
        # address perms offset dev inode path: read-only, private or shared, a shared library
        if len(fields) < 6 or "w" in fields[1] or ".so" not in fields[5].rsplit("/", 1)[-1]:
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if madvise(start, end - start, MADV_PAGEOUT) != 0:
            return 0                       # EINVAL: no MADV_PAGEOUT here; nothing to release
    after = proc_kib_field("/proc/self/status", "RssFile")
    return max(0, before - after) if before is not None and after is not None else 0


def malloc_trim():
    """glibc's ``malloc_trim`` (a ctypes function), None elsewhere (musl and
    other C libraries, other systems); looked up once."""
    if not _TRIM:
        fn = None
        if platform.system() == "Linux":
            import ctypes
            try:
                fn = ctypes.CDLL(None).malloc_trim
            except (OSError, AttributeError):   # musl and other C libraries have no malloc_trim
                fn = None
        _TRIM.append(fn)
    return _TRIM[0]


def proc_kib_field(path: str, key: str) -> int | None:
    """Bytes of a ``key: N kB`` line of a /proc file (/proc/meminfo,
    /proc/self/status), None where there is no such file or line."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _peak_rss_bytes() -> int | None:
    return proc_kib_field("/proc/self/status", "VmHWM")


def _reset_peak_rss() -> bool:
    """Reset the kernel's resident-set high-water mark (Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def host_peak_bytes(run: Callable[[], None]) -> int:
    """Memory ``run()`` needed beyond what the process held before it: the
    resident-set high-water mark during it (or, where that cannot be reset,
    the resident set after it) minus the resident set before."""
    before = rss_bytes()
    reset = _reset_peak_rss()
    run()
    peak = _peak_rss_bytes() if reset else None
    return max(0, (peak if peak is not None else rss_bytes()) - before)
