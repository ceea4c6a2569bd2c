"""Compiled CPU kernels (ops/csrc/), built once per machine and Paddle version.

``prepare()`` builds the extension with paddle.utils.cpp_extension.load
(10-50 s) or loads the cached build; the engine process calls it before it
reports ready, so no request waits for a compiler. The build lives in a
cache folder keyed by the source, flags, Paddle build (version, commit,
CUDA) and CPU, shared by every virtualenv with that Paddle:
$FDX_CACHE_DIR, else $XDG_CACHE_HOME/fdx, else ~/.cache/fdx, then
ops/<key>. The compiler's output goes to ops/<key>/build.log, and one log
line says what was built and how long it took. Without a C++ compiler, or
if the build fails, one warning says so and callers use the Paddle path.
FDX_DISABLE_CPP_OPS=1 turns the compiled kernels off.

The kernels (one extension module: the bindings and portable builds in
csrc/fdx_ops.cc, the x86 builds in csrc/isa_avx2.cc and csrc/isa_avx512.cc,
translation units of their own linked with it; on a compiler or CPU without
x86 those compile to nothing and only their builds are missing):
paged attention over block tables (fdx.ops.attention's "cpp" path),
SiLU-and-mul (fdx.ops.activation), RMS norm with the residual add
(fdx.ops.norm) and the fused q/k/v split + q/k RMS norm
+ rotary + KV-cache write (``rope_write_kv``, which the ``cpu`` attention
backend offers the model), and the products with quantized weights
(``quant_matmul_*``, which fdx.ops.quant dispatches to: one build per
instruction set, each its own kernel-table name), and whole decoder layers
over GGML-block or float32 weights (``decoder_layer``, one layer, and
``decoder_stack``, every layer of a step: one plain C function called
through ctypes, which the model-level kernel port fdx.ops.layer_port calls).
Each has the Paddle ops as
fallback and test oracle.
"""
import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import paddle

from fdx.core import kernels
from fdx.core.host import cache_root, cpu_id, portable_kernels
from fdx.ops import kernel_cache

__all__ = ["available", "loaded", "unavailable_reason", "paged_attention", "silu_and_mul", "rms_norm",
           "add_rms_norm", "rope_write_kv", "kv8_write", "QUANT_KINDS", "QUANT_VARIANTS", "QUANT_MATMULS", "quant_kernel_name",
           "quant_kernel_names", "quant_supported", "F32_KERNEL_NAMES", "F32_MATMULS", "F32_BLAS_MIN_ROWS",
           "F32_BLAS_MIN_ROWS_BY_VARIANT", "f32_blas_min_rows", "f32_build", "quant_build", "F32_MIN_ROWS",
           "f32_kernel_name", "decoder_layer", "decoder_stack", "stack_layers", "DECODER_LAYER_KINDS",
           "build_dir", "prepare", "status", "quant_blas_min_rows", "QUANT_BLAS_MIN_ROWS_VNNI",
           "QUANT_BLAS_MIN_ROWS_AVX2", "QUANT_AVX2_TILE_MIN_ROWS", "QUANT_AVX2_PANEL_MIN_ROWS", "read_bandwidth",
           "QUANT_VNNI_MIN_ROWS", "row_invariant_rows", "ATTENTION_INVARIANT_STEP_ROWS",
           "attention_invariant_every_step", "RMS_NORM_CPP_MIN_ROWS", "step_row_invariant_rows"]

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "fdx_ops.cc", _CSRC / "isa_avx2.cc", _CSRC / "isa_avx512.cc"]
_HEADERS = [_CSRC / "paged_attention_kernel.h", _CSRC / "fused_kernels.h", _CSRC / "quant_kernels.h",
            _CSRC / "quant_kernels.inc", _CSRC / "avx2_tiles.inc", _CSRC / "panel_gemm.inc", _CSRC / "panel_common.inc",
            _CSRC / "panel_gemm_avx2.inc", _CSRC / "f32_kernels.h",
            _CSRC / "f32_kernels.inc",
            _CSRC / "decoder_layer.h",
            _CSRC / "invariant_attention.h", _CSRC / "kv8_kernels.h", _CSRC / "kv8_ops.inc",
            # fdx_moe_experts (fdx.ops.moe drives it) and fdx_parts_matmul (fdx.ops.parts)
            _CSRC / "moe_kernels.h", _CSRC / "fused_parts.h", _CSRC / "fused_parts.inc", _CSRC / "fused_parts_ops.inc"]
_CFLAGS = [
    "-O3", "-fopenmp", "-std=c++17", "-ffp-contract=fast", "-fno-math-errno",
    # no -fassociative-math: every sum keeps the order the source writes, so a row's bits
    # do not depend on the code an inlined kernel lands in (issue 40 item 4); no -ffinite-math-only
    "-fno-signed-zeros", "-fno-trapping-math",
]


def _cflags() -> list[str]:
    """-march=native (the build is keyed by this CPU's model and flags, so a
    cache folder copied from another CPU is never loaded), or with
    FDX_PORTABLE_KERNELS=1 the architecture's baseline instruction set
    (x86-64: SSE2) and no x86 unit (FDX_NO_X86: isa_avx2.cc and isa_avx512.cc
    compile to nothing, every kernel runs its portable build)."""
    return (["-mtune=generic", "-DFDX_NO_X86"] if portable_kernels() else ["-march=native"]) + _CFLAGS


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
_library: Path | None = None                 # the loaded module's shared library (decoder_stack calls it by ctypes)
_error: str | None = None
_tried = False
_status: str | None = None                   # what prepare() did, in words (the log line)

# What the fallback costs, measured with python -m fdx.ops.bench_attention (median per
# layer, 64 sequences decoding over 256 cached tokens, SmolLM2's 9/3 heads, one thread).
PADDLE_PATH_COST = ("decode attention about 2.5x slower (4.2 ms against 1.7 ms a layer at 64 sequences "
                    "x 256 tokens; python -m fdx.ops.bench_attention), SiLU-and-mul and rotary + KV write "
                    "5-9x slower at 64 rows (python -m fdx.plugins.backends.bench_kernels)")


# os.environ's own store, read directly: _disabled runs in every compiled op's dispatch (some 120
# calls a decode step of a 30-layer model), and os.environ.get of an unset name costs about 3 us there
# (a KeyError raised and caught inside Mapping.get) against 0.05. Still read each call, so setting or
# unsetting FDX_DISABLE_CPP_OPS at run time (os.environ, monkeypatch.setenv) takes effect at once.
_ENV_STORE = getattr(os.environ, "_data", None)
_DISABLE_KEY = os.environ.encodekey("FDX_DISABLE_CPP_OPS") if _ENV_STORE is not None else None


def _disabled() -> bool:
    if _ENV_STORE is not None:
        raw = _ENV_STORE.get(_DISABLE_KEY)
        if raw is None:
            return False
        value = os.environ.decodevalue(raw)
    else:
        value = os.environ.get("FDX_DISABLE_CPP_OPS", "")
    return value.strip().lower() not in ("", "0", "false", "no")


def paddle_build() -> str:
    """Which Paddle: version, source commit, CUDA or not (the library the kernel links)."""
    v = paddle.version
    commit = getattr(v, "commit", "")
    cuda = v.cuda() if callable(getattr(v, "cuda", None)) else ""
    return f"{paddle.__version__} {commit} cuda={cuda}"


def build_dir() -> Path:
    """The build folder for this source, flags, Paddle build and CPU.

    Not keyed by where Paddle is installed: every virtualenv with the same Paddle
    shares one build. The library finds libpaddle.so and libiomp5.so by
    name among those already loaded (Paddle is imported first), so the
    run path written at build time, another virtualenv's, is not used."""
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    paddle_dir = str(Path(paddle.__file__).parent)
    h.update(" ".join(_cflags() + [f.replace(paddle_dir, "<paddle>") for f in _LDFLAGS]).encode())
    h.update(f"{paddle_build()} {platform.machine()} {cpu_id()}".encode())
    return cache_root() / "ops" / h.hexdigest()[:16]


@contextlib.contextmanager
def _output_to(log_path: Path):
    """Send this process's stdout and stderr (the compiler's command lines and
    warnings, Paddle's INFO lines, child processes' output) to a file."""
    ext_logger = logging.getLogger("utils.cpp_extension")
    level = ext_logger.level
    ext_logger.setLevel(logging.WARNING)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log_file:
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            ext_logger.setLevel(level)


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _build_or_load() -> tuple[ModuleType, bool]:
    """(the module, whether it was compiled now rather than loaded from the cache)."""
    from paddle.utils.cpp_extension import load

    path = build_dir()
    name = f"fdx_ops_{path.name}"
    path = kernel_cache.checked_dir(path)    # created 0700 and checked, else a private folder (warned)
    # One builder at a time across processes (tensor-parallel workers, test runners).
    with open(path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / ".built").exists() and kernel_cache.verified(path, path / name / f"{name}.so"):
            try:  # already built: load the library without load()'s setup.py run (~6 s)
                from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

                with _output_to(path / "build.log"):
                    module = _import_module_from_library(name, str(path / name))
                _note_library(path, name)
                return module, False
            except Exception as e:
                logger.info("reloading the cached fdx ops failed (%s); rebuilding", e)
        if _compiler() is None:
            raise RuntimeError("no C++ compiler (c++ or g++) on PATH")
        with _output_to(path / "build.log"):
            module = load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                extra_cxx_cflags=_cflags(),
                extra_ldflags=_LDFLAGS,
                build_directory=str(path),
                verbose=False,
            )
        kernel_cache.record(path / name / f"{name}.so")     # what the load above checks
        (path / ".built").touch()
        _note_library(path, name)
        return module, True


def _note_library(path: Path, name: str) -> None:
    """Remember the extension's .so (already loaded by Paddle) for decoder_stack."""
    global _library
    found = path / name / f"{name}.so"
    _library = found if found.exists() else next(iter(sorted(path.rglob(f"{name}*.so"))), None)


def _load() -> ModuleType | None:
    global _module, _error, _tried, _status
    with _lock:
        if not _tried:
            _tried = True
            t0 = time.perf_counter()
            try:
                _module, built = _build_or_load()
                secs = time.perf_counter() - t0
                if built:
                    _status = (f"built the compiled CPU kernels (ops/csrc/fdx_ops.cc, isa_avx2.cc, isa_avx512.cc: "
                               f"paged attention, SiLU-and-mul, RMS norm, "
                               f"rotary + KV write) in {secs:.1f} s, "
                               f"cached in {build_dir()} (compiler output: build.log there)")
                    logger.info("%s", _status)
                else:
                    _status = f"loaded the compiled CPU kernels from {build_dir()} in {secs:.1f} s"
                    logger.info("%s", _status)         # the page's figure (waiting for another build included)
            except Exception as e:  # any build or load failure means: use the Paddle path
                _error = f"{type(e).__name__}: {e}"
                try:
                    log_hint = build_dir() / "build.log"
                    where = f"; compiler output in {log_hint}" if log_hint.exists() else ""
                except OSError:
                    where = ""
                first = _first_compiler_error(log_hint) if where else None
                if first:
                    _error += f" (the compiler: {first})"
                _status = f"the compiled CPU kernels are unavailable ({_error}{where})"
                logger.warning("%s: using the Paddle path, %s", _status, PADDLE_PATH_COST)
    return _module


def _first_compiler_error(log: Path) -> str | None:
    """The compiler's first error line in the build log. Paddle's load() compiles the sources
    in threads and only prints a source's failure, so the build then stops at the link with
    that source's object missing ("cannot find ...isa_avx2.o"): this names the cause."""
    try:
        for line in log.read_text(errors="replace").splitlines():
            if " error: " in line or line.startswith("error: "):
                return line.strip()[:400]
    except OSError:
        pass
    return None


def prepare() -> str:
    """Build or load the compiled kernels now (the engine calls this before
    it reports ready); returns what was done, in words."""
    if _disabled():
        return "compiled kernels off (FDX_DISABLE_CPP_OPS): Paddle path"
    _load()
    return _status or ""


def status() -> str | None:
    """What prepare() did, or None before it ran."""
    return _status


def available() -> bool:
    """True if the compiled kernels are enabled and built (builds on first call)."""
    return not _disabled() and _load() is not None


def loaded() -> bool:
    """True if the compiled kernels are enabled and already built or loaded
    (by prepare() or available()); never starts a build."""
    return _module is not None and not _disabled()


def unavailable_reason() -> str | None:
    if _disabled():
        return "FDX_DISABLE_CPP_OPS is set"
    return None if _load() is not None else _error


@kernels.implements("cpp.paged_attention")
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
    invariant: bool = False,
    default_kernels: str | None = None,
) -> paddle.Tensor:
    """The kernel behind fdx.ops.attention's "cpp" path (see csrc/paged_attention_kernel.h);
    ``invariant``: the batch-invariant kernel (csrc/invariant_attention.h).
    ``default_kernels``, TESTS ONLY: "avx2" or "portable" runs that build's default-mode kernels
    at every step, where the default mode may take the batch-invariant kernel (on a CPU with
    AVX-512 at every step); ignored with ``invariant``, and "avx2" is the portable build's where
    the CPU has no AVX2 or head_dim is not 64 or 128 (csrc/paged_attention_kernel.h ForceDefault)."""
    module = _module_or_raise()
    if not q.is_contiguous():
        q = q.contiguous()
    if k_cache.dtype == paddle.int8:        # cache.kv_cache_dtype int8 (csrc/kv8_kernels.h): invariant always
        return module.fdx_kv8_attention(q, k_cache, v_cache, seq_info, block_tables, float(scale),
                                        int(num_kv_heads), int(block_size), int(num_out_tokens))
    try:
        route = 1 if invariant else _ATTENTION_ROUTES[default_kernels]
    except KeyError:
        raise ValueError(f"default_kernels {default_kernels!r}: one of {list(_ATTENTION_ROUTES)}") from None
    return module.fdx_paged_attention(
        q, k_cache, v_cache, seq_info, block_tables, float(scale), int(num_kv_heads), int(block_size),
        int(num_out_tokens), route,
    )


# fdx_paged_attention's route (csrc/fdx_ops.cc): 0 the default mode, 1 (invariant) the batch-invariant
# kernel; tests only, the default mode's kernels of one build at every step (see paged_attention)
_ATTENTION_ROUTES = {None: 0, "avx2": 2, "portable": 3}


def _module_or_raise() -> ModuleType:
    module = _module if _module is not None else _load()
    if module is None:
        raise RuntimeError(f"fdx compiled CPU ops unavailable: {_error}")
    return module


@kernels.implements("cpp.silu_and_mul")
def silu_and_mul(x: paddle.Tensor) -> paddle.Tensor:
    """[N, 2I] float32 -> [N, I]: silu(x[:, :I]) * x[:, I:] (csrc/fused_kernels.h)."""
    out = _module_or_raise().fdx_silu_and_mul(_rows(x))
    return out if len(x.shape) == 2 else out.reshape(x.shape[:-1] + [x.shape[-1] // 2])


def _rows(x: paddle.Tensor) -> paddle.Tensor:
    """x as a contiguous [rows, last dim] tensor (a view when it already is one)."""
    if len(x.shape) != 2:
        x = x.reshape([-1, x.shape[-1]])
    return x if x.is_contiguous() else x.contiguous()


@kernels.implements("cpp.rms_norm")
def rms_norm(x: paddle.Tensor, weight: paddle.Tensor, eps: float) -> paddle.Tensor:
    """x * rsqrt(mean(x^2, last dim) + eps) * weight over float32 [..., H] (csrc/fused_kernels.h)."""
    out = _module_or_raise().fdx_rms_norm(_rows(x), weight, float(eps))
    return out if len(x.shape) == 2 else out.reshape(x.shape)


@kernels.implements("cpp.add_rms_norm")
def add_rms_norm(x: paddle.Tensor, residual: paddle.Tensor, weight: paddle.Tensor, eps: float
                 ) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over float32 [..., H]."""
    out, summed = _module_or_raise().fdx_add_rms_norm(_rows(x), _rows(residual), weight, float(eps))
    if len(x.shape) != 2:
        out, summed = out.reshape(x.shape), summed.reshape(x.shape)
    return out, summed


@kernels.implements("cpp.rope_write_kv")
def rope_write_kv(
    qkv: paddle.Tensor,
    positions: paddle.Tensor,
    slots: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    q_norm: paddle.Tensor | None,
    k_norm: paddle.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    neox: bool,
    eps: float,
) -> paddle.Tensor:
    """The fused projection qkv [N, (H + 2 KVH) D] -> q [N, H, D]: per-head RMS
    norm of q and k (when their weights are given), rotary at ``positions``
    with the [P, D] tables cos and sin (neox: halves; else pairs 2i, 2i+1),
    and k, v written in place at ``slots`` of the head-major caches
    (csrc/fused_kernels.h). Every float tensor is float32."""
    module = _module_or_raise()
    if not qkv.is_contiguous():
        qkv = qkv.contiguous()
    op = module.fdx_rope_write_kv8 if k_cache.dtype == paddle.int8 else module.fdx_rope_write_kv   # int8: kv8_ops.inc
    return op(
        qkv, positions, slots, k_cache, v_cache, cos, sin, q_norm, k_norm, int(num_heads), int(num_kv_heads),
        int(rotary_dim), bool(neox), float(eps),
    )


# --- the 8-bit KV cache (csrc/kv8_kernels.h; cache.kv_cache_dtype int8) ---------------------------

# an int8 cache exists only where cpp.paged_attention passed its probe (the backend refuses
# cache.kv_cache_dtype int8 otherwise): the write belongs to that kernel
@kernels.implements("cpp.paged_attention")
def kv8_write(k: paddle.Tensor, v: paddle.Tensor, slots: paddle.Tensor, k_cache: paddle.Tensor,
              v_cache: paddle.Tensor) -> None:
    """k, v float32 [N, KVH, D] quantized into the int8 caches [KVH * num_slots, D + 4] at
    ``slots`` (int64 [N]), in place: per row D int8 values and a float32 scale (max |x| / 127)."""
    module = _module_or_raise()
    module.fdx_kv8_write(k if k.is_contiguous() else k.contiguous(), v if v.is_contiguous() else v.contiguous(),
                         slots, k_cache, v_cache)


# --- products with quantized weights (csrc/quant_kernels.h) -----------------------------------

QUANT_KINDS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "wint8", "wint4",
               "q2_k", "q3_k")  # = C++ Kind
QUANT_VARIANTS = ("avx512", "avx2", "portable")            # best first
_VARIANT_CODE = {"portable": 0, "avx2": 1, "avx512": 2}     # = C++ Variant
# From this many activation rows a product dequantizes the weight (compiled, threaded)
# and multiplies in Paddle's BLAS; below, int8 dot products straight from the blocks
# (tiles of 2 weight rows x 4 activation rows). Measured on the Zen 3 of
# docs/benchmarks.md (python -m fdx.plugins.backends.bench_kernels --quant q4_1,q8_0 --threads 1
# --cpu-time --rows 16,64,128,512): at 16 and 64 rows the int8 path took 0.5-1.2x the
# time of dequantize + BLAS (about 0.7x summed over a SmolLM2 layer, 0.45-0.5x for
# the 49152x576 LM head), at 128 rows about 1.0x summed, at 512 rows 1.3-1.8x.
QUANT_BLAS_MIN_ROWS = 128
# On a CPU with AVX-512 VNNI (the avx512 build): per kind, the row count from which
# dequantize + BLAS takes over (None: never; absent: QUANT_BLAS_MIN_ROWS). q8_0,
# q5_0 and wint8 take 512-bit vpdpbusd tiles from 12 rows (q4_0, wint4: M1VnniMatmul now) (quant_kernels.inc,
# Q8VnniMatmul); the others their 256-bit tiles. Measured on the Zen 4 of issue 34,
# shared with 4 other jobs (load 6-10: single ratios moved by 30%), 1 and 2 threads,
# alternating call by call, 7 rounds, 2048x2048 and 8192x2048, two runs (python -m
# fdx.plugins.backends.bench_kernels --prefill --iters 7 --threads 1|2): dequantize +
# BLAS / integer tiles at 128 rows 0.87-2.9x, above 1 in all but 3 of 40 figures
# (q5_1 0.86-1.44x keeps 128); at 512 rows q8_0 1.27-1.55x, q4_0 0.83-1.44x (1 of 8
# below 1), wint8 1.06-1.96x, wint4 1.21-1.33x (never dequantized: no float32 copy of
# the weight either), q4_k 0.87-1.11x, q6_k 0.78-1.25x, q5_k 0.80-1.02x, q5_0
# 0.73-1.18x, q4_1 0.77-1.24x (BLAS from 512). The k-quants take vpdpbusd tiles
# (TileKVnni) at every row count: dequantize + BLAS / their tiles, same run, 2048x2048
# and 8192x2048, load 14-17 (bench_kernels --prefill q4_k,q5_k,q6_k --rows 32,128,512
# --iters 5, --threads 1 --cpu-time and --threads 2): 1 thread 5.2-6.8x at 32 rows,
# 2.2-2.6x at 128, 1.31-1.51x at 512; 2 threads 1.9-2.6x at 128, 1.45-2.09x at 512:
# never dequantized (no float32 copy of a Q4_K_M file's gate/up in a prefill). q4_1 and
# q5_1 take their VNNI tiles (M1VnniMatmul) at every row count: dequantize + BLAS / those
# tiles, 1 thread, CPU time, load 25 (bench_kernels --prefill q4_1,q5_1 --rows 128,512
# --iters 5 --threads 1 --cpu-time): q4_1 2.7-3.0x at 128 rows, 1.72-1.73x at 512; q5_1
# 2.5x and 1.5x: never dequantized either.
QUANT_BLAS_MIN_ROWS_VNNI: dict[str, int | None] = {
    "q8_0": None, "q4_0": None, "wint8": None, "wint4": None, "q4_k": None, "q5_k": None, "q6_k": None,
    "q2_k": None, "q3_k": None, "q4_1": None, "q5_1": None, "q5_0": 512}
# From this many activation rows, on a CPU with AVX-512 VNNI, the integer products are the
# panel product (csrc/panel_gemm.inc, = kPanelMinRows there; under backend.batch_invariant
# QUANT_PANEL_M1_MIN_ROWS, below): per 16 weight rows decoded once a call into an L2-resident
# panel of unsigned bytes, one vpdpbusd microkernel over all the activation rows.
# Measured on the Zen 5, 1 thread, CPU time, load 9, 2048x2048 and 8192x2048, the panel at
# every row count against the kernels below it (python -m fdx.plugins.backends.bench_kernels
# --prefill KINDS --rows 8,16,24,32 --iters 5 --threads 1 --cpu-time --force-panel): level
# or ahead from 8-12 rows for wint8 (1.03-1.09x at 8), 16 for q8_0 (0.95-1.38x) and q4_k
# (1.01x), 24 for q6_k (1.09-1.22x) and q5_k (1.09-1.27x), 32 for q4_0 (1.05-1.19x; 0.83-1.04x at
# 24) and q4_1 (1.01-1.30x), whose kernels below take 4 weight rows a vpdpbusd already;
# q5_0, q5_1, wint4 from the first build's figures (before the transposed decode: level at
# 16-24). At 512 rows 1.9-3.6x them (docs/backends.md, "The panel product"). q2_k and q3_k
# (their integer scale per 16 folded into the panel's bytes; q2_k's mins in integers once
# per 256), against TileKVnni, Zen 5, 1 thread, CPU time, load 2-8, two runs each (same
# command, --rows 8,16,24,32,128,512): q3_k 0.72-0.93x at 16 rows, 1.09-1.44x at 24,
# 2.5-2.8x at 128, 3.0-3.1x at 512; q2_k 0.92-1.01x at 16, 1.35-1.53x at 24, 2.4-2.6x at
# 128, 2.5-2.6x at 512: from 24.
# q5_0 and wint8 take their 512-bit VNNI tiles (Q8VnniMatmul) from this many rows (= kVnniMinRows,
# csrc/quant_kernels.inc; wint8 TileM1VnniQ8 below, q5_0 the 256-bit tiles); not under
# backend.batch_invariant, where wint8 takes TileM1VnniQ8 at every row count. q8_0 takes
# TileM1VnniQ8 at every row count below its panel product (at 12-15 rows 1.16-1.63x
# Q8VnniMatmul: 49152x576, 576x576, 1536x576, 2048x8192, both layouts, Zen 5, 1 thread, CPU
# time, alternated, load 5).
QUANT_VNNI_MIN_ROWS = 12
QUANT_PANEL_MIN_ROWS_VNNI = {"wint8": 12, "q8_0": 16, "q5_0": 16, "q4_k": 16, "q5_1": 24, "wint4": 24, "q5_k": 24,
                             "q6_k": 24, "q2_k": 24, "q3_k": 24, "q4_0": 32, "q4_1": 32}
# Under backend.batch_invariant the kinds whose kernel below the panel is TileM1Vnni at every
# row count (q4_0, q4_1, q5_1, wint4) take the panel in TileM1Vnni's float order (PanelTileM1,
# csrc/panel_gemm.inc: a row's bits are its 1-row product's) from this many rows (= kPanelM1MinRows
# there); the other kinds keep their invariant kernels at every row count. Measured on the Zen 5,
# 1 thread, CPU time, load 4, alternated call by call, 7 rounds, the panel forced (kCodePanel)
# against TileM1Vnni (kCodeNoPanel), both under kCodeInvariant, the layouts the probe picks (q4_1,
# q5_1 interleaved; q4_0, wint4 plain), at 576x576, 1536x576, 576x1536 (the embedded model),
# 2048x8192 and 8192x2048 (a 1.7B layer) (python scripts/bench_invariant_panel.py), at 16 / 24 /
# 32 / 128 / 512 rows: q4_0 0.83-1.00x / 0.98-1.14x / 1.05-1.20x / 1.30-1.54x / 1.29-1.58x; q4_1
# 0.86-1.14x / 1.01-1.28x / 1.03-1.36x / 1.40-1.66x / 1.53-1.74x; q5_1 0.96-1.30x / 1.19-1.48x /
# 1.31-1.59x / 1.71-1.95x / 1.83-2.10x; wint4 0.81-0.94x / 0.97-1.09x / 1.09-1.19x / 1.47-1.60x /
# 1.60-1.70x. Tile widths 2, 3, 5, 6 activation rows (4 float sums each) against 4, each in its
# own run: none ahead (q4_1 at 2048x8192, 512 rows: 51.7, 41.2, 44.2, 41.0 ms against 39.2). In
# the default mode this order is 0.68-0.80x the panel's (q4_0, q4_1, 32-512 rows, --default):
# not taken there.
QUANT_PANEL_M1_MIN_ROWS = {"q4_1": 24, "q5_1": 24, "q4_0": 32, "wint4": 32}


# The AVX2 build (an AVX2-only CPU, e.g. Zen 1-3): q8_0, q4_0, q4_1, q5_0, q5_1, wint8 and
# wint4 take many-row tiles from QUANT_AVX2_TILE_MIN_ROWS rows (= kOctMinRows, kOctMinRowsK,
# csrc/avx2_tiles.inc: a weight row's 4 quants broadcast against 8 activation rows, one lane
# each), never dequantized. Measured on the Zen 5 with the AVX2 build and MKL held to AVX2
# (MKL_ENABLE_INSTRUCTIONS=AVX2, as on an AVX2 CPU), load 11-14, alternating call by call, 5
# rounds, 2048x2048 and 8192x2048 (python -m fdx.plugins.backends.bench_kernels --prefill
# q8_0,q4_0,q4_1,q5_0,q5_1,wint8,wint4 --variant avx2 --iters 5, --threads 1 --cpu-time and
# --threads 2): the tiles against the row tiles 1.5-2.4x from 32 rows for the 4- and 5-bit
# kinds, 0.99-1.15x at 32 and 1.06-1.16x from 128 for q8_0 and wint8; dequantize + BLAS /
# the tiles, 1 thread, at 128 rows 0.92-1.10x (2048x2048) and 2.0-2.3x (8192x2048), at 512 0.73-0.84x and
# 1.02-1.18x (a SmolLM2-1.7B layer's products summed: about 1.09x for q4_0) for the 4- and
# 5-bit kinds; q8_0 and wint8 0.59-0.81x at 512 (BLAS from 512 until their panel, below),
# 0.78-1.67x at 128. 2
# threads (wall time on the 2 loaded cores: single figures moved 2x, ratios less): the
# 4- and 5-bit kinds 1.07-1.79x at 512 rows, 1.3-2.9x at 128; q8_0, wint8 0.75-0.90x at 512.
# (Here the AVX2 build compiles with -march=native of an AVX-512 CPU: GCC may give it 32
# vector registers; the tiles are written for 16. To be repeated on the Zen 3.)
# The k-quants but q3_k take the same lanes per super-block of 256 from 16 rows
# (OctMatmulK): against TileDotK 1.3-3.7x at 16-512 rows; dequantize + BLAS / these at 512
# rows, 1 thread (CPU time): q4_k 1.08-1.13x, q5_k 0.99-1.01x, q6_k 1.37-1.44x, q2_k 1.61-1.63x
# (2.0-3.7x at 128); 2 threads (wall): 1.09-1.14x, 1.09-1.14x, 1.36-1.60x, 1.47-1.73x. q3_k
# has no such tile: the panel product from 16 rows (below), never dequantized.
QUANT_AVX2_TILE_MIN_ROWS = {"q8_0": 32, "wint8": 32, "q4_0": 16, "q4_1": 16, "q5_0": 16, "q5_1": 16, "wint4": 16,
                            "q4_k": 16, "q5_k": 16, "q6_k": 16, "q2_k": 16}
# From this many activation rows the AVX2 build's integer products are the panel product
# (csrc/panel_gemm_avx2.inc, = kPanelMinRows there; not under backend.batch_invariant): per
# 8 weight rows decoded once a call into unsigned bytes, one maddubs microkernel over all the
# activation rows, 3 at a time; q8_0 and wint8 (quants -128..127) with the sign trick (|w| the
# unsigned operand, x with w's sign: exact pair sums, widened every group), 6 rows at a time.
# None: only with kCodePanel (tests, bench_kernels --force-panel). Measured on the Zen 5 with
# the AVX2 build compiled for 16 vector registers as on an AVX2 CPU (-march=znver3 in place of
# -march=native, which here gives the AVX2 build 32), MKL held to AVX2, 1 thread, CPU time, load 10-12, 2048x2048 and
# 8192x2048, the panel at every row count against OctMatmul/OctMatmulK (python -m
# fdx.plugins.backends.bench_kernels --prefill KINDS --variant avx2 --rows 32,128,512 --iters
# 3 --threads 1 --cpu-time --force-panel): q5_0 1.14-1.17x at 32 rows, 1.43-1.47x at 512; q5_1
# 1.08-1.09x, 1.38-1.39x; q5_k 1.04x, 1.27-1.32x; q4_0 0.81-0.92x at 32, 1.09-1.15x at 128,
# 1.13-1.18x at 512; q6_k 0.81-0.85x at 32, 0.96-1.02x at 128, 1.09x at 512; level or behind:
# q4_k 0.95-1.06x at 128, 0.98-1.02x at 512, q4_1 0.92-0.96x, wint4 0.99-1.06x. With 32
# registers (the plain -march=native build here, 4 rows a tile) 1.37-1.88x at 512 rows for
# all of them. Dequantize + BLAS / the panel at 512 rows 0.87-1.47x (q5_k 0.87x at 2048x2048,
# 1.21x at 8192x2048): none of these kinds dequantizes (QUANT_BLAS_MIN_ROWS_AVX2).
# q2_k (u = q s, its scale per 16 folded in) and q3_k (u = q, a scale per 16), the same
# build and command (--prefill q2_k,q3_k --rows 16,32,64,128,512 --iters 5), load 5-8:
# q3_k against TileDotK (it has no OctMatmulK) 1.09-1.11x at 16 rows, 1.34-1.48x at 32,
# 1.66-1.73x at 128, 1.68-1.70x at 512, and dequantize + BLAS / the panel 1.82x / 3.13x at 128
# rows, 1.09x / 1.41x at 512 (2048x2048 / 8192x2048): the panel from 16 rows, never
# dequantized (was BLAS from 128). q2_k 0.56-0.60x OctMatmulK at 16, 0.89x at 512: not taken.
# q8_0 and wint8, same build and command (--rows 16,32,128,512, load 3-6), the panel / the
# kernels below it (the row tiles below 32, OctMatmul from there), three runs: q8_0 1.07-1.12x
# at 16 rows, 1.28-1.39x at 24, 1.14-1.23x at 32, 1.38-1.54x from 128; wint8 0.95-1.11x at 16,
# 1.15-1.26x at 24, 1.19-1.25x at 32, 1.40-1.54x from 128. Dequantize + BLAS / the panel at 512
# rows: q8_0 1.11-1.13x (2048x2048) and 1.18-1.19x (8192x2048), wint8 0.86-0.87x and 1.18-1.32x;
# summed over a SmolLM2-1.7B layer's products (4 of 2048x2048, 3 of 8192x2048's size) q8_0
# 1.17x, wint8 1.10-1.20x; 2 threads (wall, loaded) q8_0 1.07-1.30x, wint8 0.84-0.85x / 1.21-1.23x.
# Further up the dequantize is spread over more rows and the BLAS takes over (--rows
# 768,1024,1536,2048 --iters 3, 1 thread): q8_0 1.04x / 1.31x at 768 rows (that layer summed
# 1.24x), 0.80x / 0.97x at 1024 (0.93x), 0.88-0.89x at 2048; wint8 0.82x / 1.02x at 768 (0.97x),
# 0.82x / 0.99x at 1024, 0.80x / 0.96x at 2048. So q8_0 dequantizes from 1024 rows, wint8 from 768
# (were 512: 0.59-0.81x OctMatmul there); a 512-token prompt runs the panel.
# docs/backends.md, "The panel product on AVX2".
QUANT_AVX2_PANEL_MIN_ROWS: dict[str, int | None] = {
    "q8_0": 16, "wint8": 24, "q3_k": 16,
    "q5_0": 32, "q5_1": 32, "q5_k": 32, "q4_0": 128, "q6_k": 512, "q4_k": None, "q4_1": None, "wint4": None,
    "q2_k": None}
QUANT_BLAS_MIN_ROWS_AVX2: dict[str, int | None] = {
    "q8_0": 1024, "wint8": 768, "q4_0": None, "q4_1": None, "q5_0": None, "q5_1": None, "wint4": None,
    "q4_k": None, "q5_k": None, "q6_k": None, "q2_k": None, "q3_k": None}


def quant_blas_min_rows(kind: str, variant: str) -> int | None:
    """From how many activation rows ``kind``'s product in build ``variant``
    dequantizes + multiplies by BLAS (not under backend.batch_invariant); None: never."""
    if variant == "avx512" and _has_vnni():
        return QUANT_BLAS_MIN_ROWS_VNNI.get(kind, QUANT_BLAS_MIN_ROWS)
    if variant == "avx2":
        return QUANT_BLAS_MIN_ROWS_AVX2.get(kind, QUANT_BLAS_MIN_ROWS)
    return QUANT_BLAS_MIN_ROWS


@functools.cache
def _has_vnni() -> bool:
    from fdx.core.host import cpu_flags
    return "avx512_vnni" in cpu_flags()


def quant_kernel_name(kind: str, variant: str) -> str:
    """The kernel-table name of ``kind``'s product in one instruction-set build:
    ``cpp.q4_1_matmul`` (portable), ``cpp.q4_1_matmul.avx2``, ``cpp.q4_1_matmul.avx512``."""
    return f"cpp.{kind}_matmul" + ("" if variant == "portable" else f".{variant}")


def quant_kernel_names() -> tuple[str, ...]:
    return tuple(quant_kernel_name(k, v) for v in QUANT_VARIANTS for k in QUANT_KINDS)


def quant_supported(w) -> bool:
    """Whether the compiled products take ``w`` (a fdx.ops.quant.QuantizedTensor):
    whole blocks along cols (256 for the k-quants, else 32), wint4 groups a
    multiple of 32. (The GGML kinds cannot be otherwise: gguf stores whole blocks.)"""
    if w.kind not in QUANT_KINDS or w.shape[1] % (256 if w.kind.endswith("_k") else 32):
        return False
    return w.kind != "wint4" or (w.group_size % 32 == 0 and w.shape[1] % w.group_size == 0)


def _quant_product(x: paddle.Tensor, w, variant: str, matmul_op, dequantize_op) -> paddle.Tensor | None:
    """x [..., cols] @ w.T -> [..., rows] by one build of csrc/quant_kernels.h,
    whose ops the declared implementations below hand in; None for a weight
    or input the kernels cannot take (``quant.matmul`` then runs the reference)."""
    if not quant_supported(w) or x.dtype != paddle.float32:
        return None
    data, scales = w.tensors()
    x2 = _rows(x)
    invariant = kernels.active().batch_invariant
    args = (quant_code(w, invariant), _VARIANT_CODE[variant], w.shape[0], w.shape[1], w.group_size)
    min_rows = quant_blas_min_rows(w.kind, variant)
    if min_rows is not None and x2.shape[0] >= min_rows and not invariant:    # BLAS's order depends on the rows
        out = paddle.matmul(x2, dequantize_op(data, scales, *args), transpose_y=True)
    else:
        out = matmul_op(x2, data, scales, *args)
    return out if len(x.shape) == 2 else out.reshape(x.shape[:-1] + [w.shape[0]])


_QUANT_KIND_CODE = {kind: code for code, kind in enumerate(QUANT_KINDS)}
_CODE_INTERLEAVED, _CODE_INVARIANT = 1 << 8, 1 << 9       # = kCodeInterleaved, kCodeInvariant (quant_kernels.h)
_CODE_ROW_TILES = 1 << 10       # = kCodeRowTiles: benchmarks only (bench_kernels --prefill/--decode): main's
#                                 q4_0 tiles, the k-quants' 256-bit path
_CODE_NO_PANEL = 1 << 11        # = kCodeNoPanel: benchmarks, tests: the integer kernels without the panel product
_CODE_PANEL = 1 << 12           # = kCodePanel: tests, benchmarks: the panel product at every row count


def quant_code(w, invariant: bool = False) -> int:
    """The kind code the compiled products take for ``w``: its kind, whether its
    rows are interleaved (repacked at load), and backend.batch_invariant (one path at
    every row count: no panel product, no dequantize + BLAS, q8_0 and wint8 the few-row
    VNNI tile TileM1VnniQ8 at every row count)."""
    return (_QUANT_KIND_CODE[w.kind] | (_CODE_INTERLEAVED if w.interleaved else 0)
            | (_CODE_INVARIANT if invariant else 0))


@kernels.implements(*(quant_kernel_name(k, "portable") for k in QUANT_KINDS))
def quant_matmul_portable(x: paddle.Tensor, w) -> paddle.Tensor:
    """The plain C++ build (the compiler's flags: -march=native, or the baseline with FDX_PORTABLE_KERNELS)."""
    m = _module_or_raise()
    return _quant_product(x, w, "portable", m.fdx_quant_matmul, m.fdx_quant_dequantize)


@kernels.implements(*(quant_kernel_name(k, "avx2") for k in QUANT_KINDS))
def quant_matmul_avx2(x: paddle.Tensor, w) -> paddle.Tensor:
    """The AVX2 + FMA + F16C build."""
    m = _module_or_raise()
    return _quant_product(x, w, "avx2", m.fdx_quant_matmul, m.fdx_quant_dequantize)


@kernels.implements(*(quant_kernel_name(k, "avx512") for k in QUANT_KINDS))
def quant_matmul_avx512(x: paddle.Tensor, w) -> paddle.Tensor:
    """The AVX-512 (F, BW, VL) build: dies by SIGILL on a CPU without it."""
    m = _module_or_raise()
    return _quant_product(x, w, "avx512", m.fdx_quant_matmul, m.fdx_quant_dequantize)


QUANT_MATMULS = {"portable": quant_matmul_portable, "avx2": quant_matmul_avx2, "avx512": quant_matmul_avx512}


# --- the float32 product for a few rows (csrc/f32_kernels.h) ------------------------------------

# From this many activation rows a float32 product is Paddle's (MKL) sgemm, below
# it the compiled one, which streams the weight once for all the rows. Measured on
# the Zen 3 of docs/benchmarks.md (a SmolLM2 layer's four products over 30 layers of
# distinct weights, 450 MB streamed from memory as a decode step does, one thread,
# CPU time, alternating): the compiled products took 1.04x MKL's time at 1 row,
# 0.47x at 4, 0.59x at 8, 0.66x at 16, 1.06x at 32, 0.98x at 64; the fused layer
# (which also drops ~13 op calls a layer) takes float32 layers below this too.
F32_BLAS_MIN_ROWS = 32
# ... except the AVX-512 build, whose products from 12 rows keep the output in
# registers (f32_kernels.inc, RowsTiled). On the Zen 4 of docs/benchmarks.md (2
# threads, best of 4-5): 30 layers' products at 32 rows 57 ms against MKL's 65, at
# 40 rows 64 against 70, at 47 86 against 77; the LM head ([576, 49152]) at 32 rows
# 18 ms against 23, at 39 21 against 26.
# The AVX2 build keeps the output in registers from 2 rows (6-row tiles; from 16 rows
# each weight panel copied contiguous first), and on the Zen 1 of docs/benchmarks.md
# (MKL_DEBUG_CPU_TYPE=5, 2 threads, the same harness) it beats MKL's sgemm at every
# row count measured up to 256 but 16-32 on the layers' shapes, where they are level
# once the LM head is counted (30 layers + head at 32 rows: 180 ms against 182); MKL's
# own paths jump at 33 rows (117 -> 218-250 ms) and come back from about 448.
F32_BLAS_MIN_ROWS_BY_VARIANT = {"avx512": 40, "avx2": 256}


def f32_blas_min_rows(variant: str | None) -> int:
    """Rows from which a float32 product is MKL's rather than ``variant``'s build."""
    return F32_BLAS_MIN_ROWS_BY_VARIANT.get(variant, F32_BLAS_MIN_ROWS)


def quant_build(kind: str, table) -> str | None:
    """The widest build of ``kind``'s product (one of QUANT_KINDS, or "f32") that the kernel
    table ``table`` passed, or None."""
    return next((v for v in QUANT_VARIANTS if table.usable(quant_kernel_name(kind, v))), None)


def f32_build(table) -> str | None:
    """The widest build of the float32 product that the kernel table ``table`` passed, or None."""
    return quant_build("f32", table)

def row_invariant_rows(kind: str, variant: str) -> int:
    """The largest row count up to which the default mode (not backend.batch_invariant) gives
    every row of a product its 1-row bits: ``kind`` one of QUANT_KINDS or ``"f32"`` (the
    float32 product, fdx.ops.dense), in build ``variant`` on this CPU. Past it the product
    takes another path (VNNI tiles, many-row tiles, the panel product, dequantize + BLAS,
    MKL), another order of its float sums. A speculative step at batch 1 scores k + 1 rows
    where a decode step scores 1: its greedy tokens are decoding's only while k + 1 is
    within this for every product of the model (docs/speculative.md; attention: a
    one-sequence step of up to 16 rows runs the batch-invariant kernel). Under
    backend.batch_invariant it holds at every row count.
    (tests/test_spec_verify_rows.py checks each kind, layout and build here: every row
    count up to it, and that the next one breaks.)"""
    if kind == "f32":
        return f32_blas_min_rows(variant) - 1          # the compiled product below, MKL's sgemm from there
    starts = [quant_blas_min_rows(kind, variant)]
    if variant == "avx512" and _has_vnni():
        starts.append(QUANT_PANEL_MIN_ROWS_VNNI.get(kind))
        if kind in ("q5_0", "wint8"):
            starts.append(QUANT_VNNI_MIN_ROWS)         # Q8VnniMatmul
    elif variant == "avx2":
        starts += [QUANT_AVX2_TILE_MIN_ROWS.get(kind), QUANT_AVX2_PANEL_MIN_ROWS.get(kind)]
    return min(s for s in starts if s is not None) - 1


# fdx.ops.norm.CPP_MIN_ROWS (the reason is there): from this many rows the RMS norm is the
# compiled kernel, below it Paddle's fused_rms_norm where that passed (other bits).
RMS_NORM_CPP_MIN_ROWS = 32

# = kInvariantStepRows (csrc/paged_attention_kernel.h): a one-sequence step of up to this many
# query tokens runs the batch-invariant attention in the default mode too.
ATTENTION_INVARIANT_STEP_ROWS = 16


def attention_invariant_every_step(head_dim: int) -> bool:
    """Whether the default mode's attention is the batch-invariant kernel at every step here
    (csrc/paged_attention_kernel.h ``InvariantStep``): the x86 builds (not
    FDX_PORTABLE_KERNELS), a CPU with AVX2, FMA and AVX-512 F, head_dim a multiple of 32."""
    if head_dim % 32 or portable_kernels() or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    from fdx.core.host import cpu_flags
    return {"avx2", "fma", "avx512f"} <= set(cpu_flags())


def step_row_invariant_rows(kinds, table=None, head_dim: int | None = None) -> int | None:
    """The largest one-sequence step (rows) in which the default mode gives every row the
    bits of a one-row step, for a model whose weights are of ``kinds`` (``Model.weight_bytes``'
    keys: GGML kinds, "f32") and whose attention heads are ``head_dim`` wide (None: not
    known), with the builds the kernel table ``table`` (the active one) takes. The least of:
    each kind's product (``row_invariant_rows``); the attention, ATTENTION_INVARIANT_STEP_ROWS
    unless it is the invariant kernel at every step (``attention_invariant_every_step``);
    the RMS norm, which takes Paddle's fused_rms_norm below RMS_NORM_CPP_MIN_ROWS rows
    and the compiled kernel from there where both passed (other bits). A batch-1
    speculative step keeps decoding's greedy tokens while k + 1 is within it. None where a
    kind is not the compiled products' (another backend's weights, bf16 ...), where the
    model does not say its kinds, or where the attention is Paddle's (the compiled one did
    not pass)."""
    table = table if table is not None else kernels.active()
    kinds = list(kinds)
    if not kinds or not table.usable("cpp.paged_attention"):
        return None
    limits = []
    if head_dim is None or not attention_invariant_every_step(head_dim):
        limits.append(ATTENTION_INVARIANT_STEP_ROWS)
    if table.usable("fused_rms_norm") and table.usable("cpp.add_rms_norm"):
        limits.append(RMS_NORM_CPP_MIN_ROWS - 1)
    for kind in kinds:
        variant = quant_build(kind, table) if kind == "f32" or kind in QUANT_KINDS else None
        if variant is None:
            return None
        limits.append(row_invariant_rows(kind, variant))
    return min(limits)


# ... and from this many rows up the compiled one (fdx.ops.dense and the fused layer).
# At 1 row the products tied MKL on one thread; at 2 threads under a load average
# of 15 (other jobs on the 2 cores) they took 1.5-2.2x MKL's wall time, every OpenMP
# barrier waiting for a descheduled thread, unmeasured on a quiet machine: 2 leaves
# batch 1 to MKL and the composed layer (docs/benchmarks.md, issue 18's fp32 round).
F32_MIN_ROWS = 1


def f32_kernel_name(variant: str) -> str:
    """``cpp.f32_matmul`` (portable), ``cpp.f32_matmul.avx2``, ``cpp.f32_matmul.avx512``."""
    return quant_kernel_name("f32", variant)


F32_KERNEL_NAMES = tuple(f32_kernel_name(v) for v in QUANT_VARIANTS)


def _f32_product(x: paddle.Tensor, w: paddle.Tensor, variant: str, matmul_op) -> paddle.Tensor:
    """x [..., K] @ w [K, N] (float32) -> [..., N] by one build of csrc/f32_kernels.h,
    whose op the declared implementations below hand in."""
    out = matmul_op(_rows(x), w if w.is_contiguous() else w.contiguous(), _VARIANT_CODE[variant])
    return out if len(x.shape) == 2 else out.reshape(x.shape[:-1] + [w.shape[1]])


@kernels.implements(f32_kernel_name("portable"))
def f32_matmul_portable(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x @ w for float32 w [in, out], the plain C++ build."""
    return _f32_product(x, w, "portable", _module_or_raise().fdx_f32_matmul)


@kernels.implements(f32_kernel_name("avx2"))
def f32_matmul_avx2(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """The AVX2 + FMA build."""
    return _f32_product(x, w, "avx2", _module_or_raise().fdx_f32_matmul)


@kernels.implements(f32_kernel_name("avx512"))
def f32_matmul_avx512(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """The AVX-512 F build: dies by SIGILL on a CPU without it."""
    return _f32_product(x, w, "avx512", _module_or_raise().fdx_f32_matmul)


F32_MATMULS = {"portable": f32_matmul_portable, "avx2": f32_matmul_avx2, "avx512": f32_matmul_avx512}


# --- decoder layers in one call (csrc/decoder_layer.h; fdx_decoder_stack in csrc/fdx_ops.cc) ------
# The model-level kernel port's one binding route (fdx.ops.layer_port): a plain C function
# called through ctypes, no Paddle op dispatch and no Python between the layers (a layer
# call through a Paddle op cost about 40 us of both, 30 a SmolLM2 step). Its two structs'
# ctypes classes are built from the layout the library reports (fdx_stack_layout): no
# mirror written by hand, so a field added to the C side reaches here with the build.

DECODER_LAYER_KINDS = QUANT_KINDS[:8]        # the GGML block kinds (no separate scales tensor)

_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "f": ctypes.c_float}


def structs_from_layout(text: str) -> dict[str, type]:
    """ctypes Structure classes from fdx_stack_layout's lines ("Name size", then
    "Name.field offset size kind"; kind p, i, f: pointers, int64, float; an array
    flattened, its size the whole array's): each field at the C offset, the struct
    the C size. RuntimeError for a line it cannot place (overlap, unknown kind, size)."""
    sizes: dict[str, int] = {}
    fields: dict[str, list[tuple[str, int, int, str]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and "." not in parts[0]:
            sizes[parts[0]] = int(parts[1])
            fields.setdefault(parts[0], [])
        elif len(parts) == 4 and "." in parts[0]:
            struct, field = parts[0].split(".", 1)
            fields.setdefault(struct, []).append((field, int(parts[1]), int(parts[2]), parts[3]))
        else:
            raise RuntimeError(f"fdx compiled CPU ops: unreadable struct layout line {line!r}")
    out = {}
    for name, found in fields.items():
        spec, at = [], 0
        for field, offset, size, kind in sorted(found, key=lambda f: f[1]):
            elem = _CTYPES.get(kind)
            if elem is None or offset < at or size <= 0 or size % ctypes.sizeof(elem):
                raise RuntimeError(f"fdx compiled CPU ops: cannot lay out {name}.{field} "
                                   f"(offset {offset}, size {size}, kind {kind!r})")
            if offset > at:
                spec.append((f"_pad{at}", ctypes.c_char * (offset - at)))
            count = size // ctypes.sizeof(elem)
            spec.append((field, elem * count if count > 1 else elem))
            at = offset + size
        if name not in sizes or sizes[name] < at:
            raise RuntimeError(f"fdx compiled CPU ops: {name}'s size is missing or below its fields'")
        if sizes[name] > at:
            spec.append((f"_pad{at}", ctypes.c_char * (sizes[name] - at)))
        out[name] = type(name, (ctypes.Structure,), {"_pack_": 1, "_fields_": spec})
        assert ctypes.sizeof(out[name]) == sizes[name]
    return out


class _Stack:
    """The library's fdx_decoder_stack and the struct classes its layout gives."""

    def __init__(self, library):
        layout = library.fdx_stack_layout
        layout.argtypes = []
        layout.restype = ctypes.c_char_p
        made = structs_from_layout(layout().decode())
        self.Layer, self.Step = made["FdxStackLayer"], made["FdxStackStep"]
        # = kMaxParts (decoder_layer.h): the weights field is [4][kMaxParts] pointers
        self.max_parts = self.Layer.weights.size // ctypes.sizeof(ctypes.c_void_p) // 4
        fn = library.fdx_decoder_stack
        fn.argtypes = [ctypes.POINTER(self.Step), ctypes.c_char_p, ctypes.c_int64]
        fn.restype = ctypes.c_int
        self.fn = fn


_stack: _Stack | None = None


def _stack_binding() -> _Stack:
    global _stack
    if _stack is None:
        _module_or_raise()
        if _library is None:
            raise RuntimeError("fdx compiled CPU ops: the extension's shared library was not found")
        _stack = _Stack(ctypes.CDLL(str(_library)))
    return _stack


def read_bandwidth(threads: int, mib: int = 128, rounds: int = 3, own_process: bool = False) -> float | None:
    """GB/s at which ``threads`` of the products' OpenMP threads read ``mib`` MiB
    together (best of ``rounds``; csrc/fdx_ops.cc fdx_read_bandwidth), or None
    without the compiled kernels. Batch-1 decode reads every weight once a
    token, so its speed follows this rate, which on a VM can change from one
    minute to the next (docs/backends.md, "Batch-1 decode and memory
    bandwidth"): benchmarks record it beside their figures. The buffer
    (four times the Zen 5's L3: 128 MiB) lives only for the call;
    ``own_process``: in a child process (ctypes and numpy, the same library),
    so that the buffer is not on this process's resident high-water mark (a
    benchmark's peak memory, ``/usr/bin/time``'s figure)."""
    if not available():
        return None
    _module_or_raise()
    if _library is None:
        return None
    if own_process:
        import subprocess
        out = subprocess.run([sys.executable, "-m", "fdx.ops.bandwidth", str(_library), str(threads), str(mib),
                              str(rounds)], capture_output=True, text=True, timeout=120)
        return float(out.stdout.split()[-1]) if out.returncode == 0 and out.stdout.split() else None
    from fdx.ops.bandwidth import read_bandwidth as read
    return read(str(_library), threads, mib, rounds)


def _part_info(w, variant: str) -> list[int]:
    """(kind, variant, rows, cols) of a fused layer's weight part (kind -1: float32 [in, out])."""
    if isinstance(w, paddle.Tensor):
        return [-1, _VARIANT_CODE[variant], int(w.shape[1]), int(w.shape[0])]
    w.tensors()                                         # repacked (at load) before its layout is read
    return [quant_code(w, kernels.active().batch_invariant), _VARIANT_CODE[variant], w.shape[0], w.shape[1]]


def _part_tensor(w) -> paddle.Tensor:
    """The tensor a part's pointer is taken from: the float32 weight, or the blocks' bytes."""
    return w if isinstance(w, paddle.Tensor) else w.tensors()[0]


def _fill_layer(entry, binding: _Stack, keep: list, input_norm, post_norm, weights, variants, biases, q_norm,
                k_norm, k_cache, v_cache) -> None:
    """One FdxStackLayer: pointers to the layer's tensors (held in ``keep``), each part's (kind, build, rows, cols)."""
    vectors = [input_norm, post_norm, *biases, q_norm, k_norm]
    for t in vectors:
        if t is not None and (t.dtype != paddle.float32 or not t.is_contiguous()):
            raise ValueError("decoder_stack: norms and biases must be contiguous float32")
    if k_cache.dtype not in (paddle.float32, paddle.int8) or v_cache.dtype != k_cache.dtype \
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("decoder_stack: the caches must be contiguous, both float32 or both int8")
    keep += [t for t in [*vectors, k_cache, v_cache] if t is not None]
    entry.input_norm, entry.post_norm = input_norm.data_ptr(), post_norm.data_ptr()
    entry.k_cache, entry.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
    for i, b in enumerate(biases):
        entry.biases[i] = None if b is None else b.data_ptr()
    entry.q_norm = None if q_norm is None else q_norm.data_ptr()
    entry.k_norm = None if k_norm is None else k_norm.data_ptr()
    m = binding.max_parts
    for i, (parts, builds) in enumerate(zip(weights, variants, strict=True)):
        if not 1 <= len(parts) <= m:
            raise ValueError(f"decoder_stack: 1 to {m} parts a weight, got {len(parts)}")
        entry.num_parts[i] = len(parts)
        for j, (w, variant) in enumerate(zip(parts, builds, strict=True)):
            data = _part_tensor(w)
            keep.append(data)
            entry.weights[i * m + j] = data.data_ptr()
            entry.info[(i * m + j) * 4:(i * m + j + 1) * 4] = _part_info(w, variant)


class StackLayers:
    """The fixed part of a step's fdx_decoder_stack call: each layer's norms,
    weight parts (with their kind and build), biases, q/k norms and caches,
    as pointers. Holds the tensors, so the pointers stay valid while it lives."""

    def __init__(self, layers: list, variants: list[list[list[str]]], kv_caches: list):
        binding = _stack_binding()
        self.layers = list(layers)     # held: their ids key the caller's cache of this table
        self.keep: list = []
        self.table = (binding.Layer * len(layers))()
        self.has_float = any(layer.has_float for layer in layers)
        for entry, layer, vs, (k, v) in zip(self.table, layers, variants, kv_caches, strict=True):
            _fill_layer(entry, binding, self.keep, layer.input_norm, layer.post_norm, layer.weights, vs,
                        layer.biases, layer.q_norm, layer.k_norm, k, v)
        first = layers[0]
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.rope, self.eps, self.scale = first.rope, first.eps, first.scale
        self.rotary_dim = getattr(first.rope, "rotary_dim", first.head_dim)
        self.cos, self.sin = first.rope.cos_cache, first.rope.sin_cache
        self.neox = bool(first.rope.is_neox_style)
        self.hidden = int(first.input_norm.shape[0])
        self.num_slots = int(kv_caches[0][0].shape[0]) // first.num_kv_heads
        self.kv8 = _kv8_caches(kv_caches, self.head_dim)
        self.first_cache = kv_caches[0][0]
        self.cache_ptr = self.first_cache.data_ptr()

    def valid_for(self, kv_caches: list) -> bool:
        """Whether the caches are still the ones (and the memory) this table points at."""
        return kv_caches[0][0] is self.first_cache and self.first_cache.data_ptr() == self.cache_ptr


def _kv8_caches(kv_caches: list, head_dim: int) -> bool:
    """Whether the caches are int8 (cache.kv_cache_dtype int8: rows of head_dim int8 values and a
    float32 scale, csrc/kv8_kernels.h) rather than float32; ValueError for a mix or a wrong width."""
    kinds = {k.dtype for kv in kv_caches for k in kv}
    int8 = kinds == {paddle.int8}
    if len(kinds) != 1 or any(int(k.shape[1]) != head_dim + 4 * int8 for kv in kv_caches for k in kv):
        raise ValueError(f"decoder_stack: every cache float32 [rows, {head_dim}] or every one int8 "
                         f"[rows, {head_dim + 4}]")
    return int8


def stack_layers(layers: list, variants: list[list[list[str]]], kv_caches: list) -> StackLayers:
    """The table ``decoder_stack`` takes: ``layers`` (FusedLayer, one shape
    and one rope for all; each weight one to three parts, GGML blocks or
    float32), the build ``variants[l][i][j]`` of layer l's weight i's part j,
    and each layer's (k, v) cache."""
    return StackLayers(layers, variants, kv_caches)


def _check_step(n: int, positions, slots, seq_info, block_tables) -> None:
    for t, dtype in ((positions, paddle.int64), (slots, paddle.int64), (seq_info, paddle.int32),
                     (block_tables, paddle.int32)):
        if t.dtype != dtype or not t.is_contiguous():
            raise ValueError("decoder_stack: positions and slots must be int64, seq_info and block_tables int32")
    if positions.shape[0] != n or slots.shape[0] != n or len(seq_info.shape) != 2 or seq_info.shape[1] != 4 \
            or len(block_tables.shape) != 2 or block_tables.shape[0] != seq_info.shape[0]:
        raise ValueError("decoder_stack: positions, slots [N], seq_info [S, 4], block_tables [S, W]")


def _run(binding: _Stack, table, first: int, count: int, x, out, residual, residual_in: bool, positions, slots,
         seq_info, block_tables, block_size: int, invariant: bool, shape) -> None:
    """One fdx_decoder_stack call over ``count`` layers of ``table`` from ``first``; ``shape``: the
    StackLayers (or one-layer stand-in) with the heads, rope and cache fields."""
    n = int(x.shape[0])
    step = binding.Step()
    step.x, step.out, step.residual = x.data_ptr(), out.data_ptr(), residual.data_ptr()
    step.positions, step.slots = positions.data_ptr(), slots.data_ptr()
    step.seq_info, step.tables = seq_info.data_ptr(), block_tables.data_ptr()
    step.cos, step.sin = shape.cos.data_ptr(), shape.sin.data_ptr()
    step.layers = ctypes.addressof(table) + first * ctypes.sizeof(binding.Layer)
    step.num_layers, step.N, step.hidden = count, n, shape.hidden
    step.num_seqs, step.table_width = seq_info.shape[0], block_tables.shape[1]
    step.num_heads, step.num_kv_heads, step.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
    step.rotary_dim, step.block_size, step.num_slots = shape.rotary_dim, int(block_size), shape.num_slots
    step.max_pos, step.neox, step.eps, step.scale = shape.cos.shape[0], int(shape.neox), shape.eps, shape.scale
    step.invariant, step.residual_in, step.kv8 = int(invariant), int(residual_in), int(shape.kv8)
    err = ctypes.create_string_buffer(256)
    if binding.fn(ctypes.byref(step), err, len(err)) != 0:
        raise ValueError(f"decoder_stack: {err.value.decode()}")


@kernels.implements("cpp.decoder_layer")
def decoder_stack(x: paddle.Tensor, table: StackLayers, positions: paddle.Tensor, slots: paddle.Tensor,
                  seq_info: paddle.Tensor, block_tables: paddle.Tensor, block_size: int, invariant: bool = False,
                  between=None) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(last MLP output, residual) of every layer in ``table`` over x [N,
    hidden] (the embedding), as ``decoder_layer`` one layer after the other
    (the first with no residual): one C call through ctypes. ``between``
    (a KV connector's hooks): called as ``between(i, "before")`` ahead of
    layer i and ``between(i, "after")`` once its K/V are in the cache
    blocks; the layers then run one C call each, the same kernels in the same
    order (equal bits). The caller keeps float32 layers to the rows
    ``decoder_layer`` takes them for."""
    binding = _stack_binding()
    x = _rows(x)
    n, hidden = x.shape
    if x.dtype != paddle.float32 or hidden != table.hidden:
        raise ValueError(f"decoder_stack: x must be float32 [N, {table.hidden}]")
    _check_step(n, positions, slots, seq_info, block_tables)
    out = paddle.empty([n, hidden], dtype="float32")
    residual = paddle.empty([n, hidden], dtype="float32")
    args = (positions, slots, seq_info, block_tables, block_size, invariant, table)
    if between is None:
        _run(binding, table.table, 0, len(table.table), x, out, residual, False, *args)
        return out, residual
    for i in range(len(table.table)):
        between(i, "before")
        _run(binding, table.table, i, 1, x if i == 0 else out, out, residual, i > 0, *args)
        between(i, "after")
    return out, residual


class _OneLayer:
    """decoder_layer's one-entry table and the step shape fields ``_run`` reads."""

    def __init__(self, binding, input_norm, post_norm, weights, variants, biases, q_norm, k_norm, k_cache, v_cache,
                 cos, sin, num_heads, num_kv_heads, rotary_dim, neox, eps, scale):
        self.keep: list = [cos, sin]
        self.table = (binding.Layer * 1)()
        _fill_layer(self.table[0], binding, self.keep, input_norm, post_norm, weights, variants, biases, q_norm,
                    k_norm, k_cache, v_cache)
        self.num_heads, self.num_kv_heads = int(num_heads), int(num_kv_heads)
        self.kv8 = _kv8_caches([(k_cache, v_cache)], int(k_cache.shape[1]) - 4 * (k_cache.dtype == paddle.int8))
        self.head_dim = int(k_cache.shape[1]) - 4 * self.kv8
        self.rotary_dim, self.neox, self.eps, self.scale = int(rotary_dim), bool(neox), float(eps), float(scale)
        self.cos, self.sin = cos, sin
        self.hidden = int(input_norm.shape[0])
        self.num_slots = int(k_cache.shape[0]) // self.num_kv_heads
        for t in (cos, sin):
            if t.dtype != paddle.float32 or not t.is_contiguous():
                raise ValueError("decoder_layer: cos and sin must be contiguous float32")


@kernels.implements("cpp.decoder_layer")
def decoder_layer(
    x: paddle.Tensor,
    residual: paddle.Tensor | None,
    input_norm: paddle.Tensor,
    post_norm: paddle.Tensor,
    weights: list,
    variants: list,
    positions: paddle.Tensor,
    slots: paddle.Tensor,
    k_cache: paddle.Tensor,
    v_cache: paddle.Tensor,
    cos: paddle.Tensor,
    sin: paddle.Tensor,
    seq_info: paddle.Tensor,
    block_tables: paddle.Tensor,
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    block_size: int,
    neox: bool,
    eps: float,
    scale: float,
    biases: tuple = (None, None, None, None),
    q_norm: paddle.Tensor | None = None,
    k_norm: paddle.Tensor | None = None,
    invariant: bool = False,
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """(MLP output, residual) of one pre-norm Llama layer: x [N, hidden]
    (plus ``residual``, or None for the first layer) through norm, q/k/v
    (+ bias), the per-head q/k RMS norms when given (Qwen3), rotary + KV
    write at ``slots``, attention over the block tables (``seq_info`` must
    list the N rows in order), o_proj (+ bias), residual add + norm, gate/up
    (+ bias), SiLU-and-mul and down (+ bias) (csrc/decoder_layer.h), by the
    same C call as ``decoder_stack`` over a one-layer table.
    ``weights``: the four linears (qkv, o, gate_up, down), each a sequence of
    one to three parts stacked along rows (output features), each part an
    fdx.ops.quant.QuantizedTensor of DECODER_LAYER_KINDS or a float32
    [in, out] tensor; ``variants``: the build ("avx2", ...) of each part, in
    the same nesting; ``biases``: each weight's [rows] bias or None. Float
    tensors float32; the caches float32 [KVH * num_slots, head_dim], or both
    int8 [KVH * num_slots, head_dim + 4] (cache.kv_cache_dtype int8: written
    quantized and read by csrc/kv8_kernels.h, as rope_write_kv and
    paged_attention do for such caches). ``invariant``: the batch-invariant
    attention (the int8 one is invariant either way)."""
    binding = _stack_binding()
    one = _OneLayer(binding, input_norm, post_norm, weights, variants, biases, q_norm, k_norm, k_cache, v_cache,
                    cos, sin, num_heads, num_kv_heads, rotary_dim, neox, eps, scale)
    x = _rows(x)
    n, hidden = x.shape
    if x.dtype != paddle.float32 or hidden != one.hidden:
        raise ValueError(f"decoder_layer: x must be float32 [N, {one.hidden}]")
    _check_step(n, positions, slots, seq_info, block_tables)
    out = paddle.empty([n, hidden], dtype="float32")
    if residual is None:
        res = paddle.empty([n, hidden], dtype="float32")
    else:
        residual = _rows(residual)
        if residual.dtype != paddle.float32 or list(residual.shape) != [n, hidden]:
            raise ValueError("decoder_layer: residual must be float32, x's shape")
        res = residual.clone()          # the C call adds into it in place; the caller's stays as it was
    _run(binding, one.table, 0, 1, x, out, res, residual is not None, positions, slots, seq_info, block_tables,
         block_size, invariant, one)
    return out, res

