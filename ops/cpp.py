"""Compiled CPU kernels (ops/csrc/), built on first use.

The extension is built with paddle.utils.cpp_extension.load (about 10 s)
into a cache folder keyed by the source, flags, Paddle version and CPU, so a
later process only loads it: $FDX_CACHE_DIR, else $XDG_CACHE_HOME/fdx, else
~/.cache/fdx, then ops/<key>. If the build fails, a warning is logged once
and callers fall back to the Paddle path. FDX_DISABLE_CPP_OPS=1 turns the
compiled kernels off.
"""
import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

import paddle

__all__ = ["available", "unavailable_reason", "paged_attention", "build_dir"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cc"]
_HEADERS = [_CSRC / "paged_attention_kernel.h"]
_CFLAGS = [
    "-O3", "-march=native", "-fopenmp", "-std=c++17", "-ffp-contract=fast", "-fno-math-errno",
    # let dot-product reductions reassociate (vector horizontal sums); no -ffinite-math-only
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
]


def _openmp_ldflags() -> list[str]:
    """Link OpenMP to the runtime Paddle's MKL uses (libiomp5) when it ships
    one: two runtimes each keep spinning worker threads, which fight over the
    cores. Else GCC's libgomp."""
    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").exists():
        return [f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp"]


_LDFLAGS = _openmp_ldflags()

_lock = threading.Lock()
_module: ModuleType | None = None
_error: str | None = None
_tried = False


def _disabled() -> bool:
    return os.environ.get("FDX_DISABLE_CPP_OPS", "").strip().lower() not in ("", "0", "false", "no")


def _cpu_id() -> str:
    """Model and feature flags: -march=native code must not run on another CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith("flags")), "")
    return f"{model} {flags}"


def _cache_root() -> Path:
    if root := os.environ.get("FDX_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fdx"


def build_dir() -> Path:
    """The build folder for this source, flags, Paddle version and CPU."""
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    h.update(f"{paddle.__version__} {platform.machine()} {_cpu_id()}".encode())
    return _cache_root() / "ops" / h.hexdigest()[:16]


@contextlib.contextmanager
def _quiet_paddle_extension_logs():
    """Paddle's cpp_extension logs INFO lines on every load."""
    ext_logger = logging.getLogger("utils.cpp_extension")
    level = ext_logger.level
    ext_logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        ext_logger.setLevel(level)


def _build() -> ModuleType:
    with _quiet_paddle_extension_logs():
        return _build_or_load()


def _build_or_load() -> ModuleType:
    from paddle.utils.cpp_extension import load

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    name = f"fdx_ops_{path.name}"
    # One builder at a time across processes (tensor-parallel workers, test runners).
    with open(path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / ".built").exists():
            try:  # already built: load the library without load()'s setup.py run (~6 s)
                from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

                return _import_module_from_library(name, str(path / name))
            except Exception as e:
                logger.info("reloading the cached fdx ops failed (%s); rebuilding", e)
        module = load(
            name=name,
            sources=[str(s) for s in _SOURCES],
            extra_cxx_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(path),
            verbose=False,
        )
        (path / ".built").touch()
        return module


def _load() -> ModuleType | None:
    global _module, _error, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                _module = _build()
            except Exception as e:  # any build or load failure means: use the Paddle path
                _error = f"{type(e).__name__}: {e}"
                logger.warning("fdx compiled CPU ops unavailable, using the Paddle path: %s", _error)
    return _module


def available() -> bool:
    """True if the compiled kernels are enabled and built (builds on first call)."""
    return not _disabled() and _load() is not None


def unavailable_reason() -> str | None:
    if _disabled():
        return "FDX_DISABLE_CPP_OPS is set"
    return None if _load() is not None else _error


def paged_attention(
    q: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    seq_info: paddle.Tensor,
    block_tables: paddle.Tensor,
    scale: float,
    num_kv_heads: int,
    block_size: int,
    num_out_tokens: int,
) -> paddle.Tensor:
    """The kernel behind fdx.ops.attention's "cpp" path (see csrc/paged_attention.cc)."""
    module = _module if _module is not None else _load()
    if module is None:
        raise RuntimeError(f"fdx compiled CPU ops unavailable: {_error}")
    if not q.is_contiguous():
        q = q.contiguous()
    return module.fdx_paged_attention(
        q, k_cache, v_cache, seq_info, block_tables, float(scale), int(num_kv_heads), int(block_size),
        int(num_out_tokens),
    )
