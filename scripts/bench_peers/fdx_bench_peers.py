"""``fdx bench peers``: fdx side by side with llama.cpp (and ik_llama.cpp) on this machine.

A developer tool kept out of the runtime package (it builds third-party
programs): it lives in scripts/bench_peers/ of a source checkout, and
``fdx bench peers`` imports it from there on demand (fdx.entrypoints.bench.load_peers).
``python scripts/bench_peers/fdx_bench_peers.py ...`` runs the same command.

1. llama.cpp is built once from the sources inside the PyPI sdist of
   llama-cpp-python (its vendor/llama.cpp; cmake with -DGGML_NATIVE=ON) and
   cached under $FDX_PEERS_CACHE (else $FDX_CACHE_DIR/peers, else
   ~/.cache/fdx/peers) in ``llama.cpp-<version>-<cpu hash>``: native code is
   CPU-specific. ik_llama.cpp is built the same way from a source tree given
   with --ik-llama-src (or $FDX_IK_LLAMA_SRC; never cloned) and run with
   run-time repack (-rtr).
2. The model: a GGUF file (default: the embedded Q4_1 SmolLM2), whose F32
   file is made with ``llama-quantize --allow-requantize`` (so it holds the
   source's quantized values), or with --shape NAME a random-weight
   checkpoint of a named real shape, written by the tool (fdx_peer_models.py),
   converted by llama.cpp's convert_hf_to_gguf.py to F16 and quantized from
   that. Each type of --quant is made with llama-quantize, cached.
3. The machine is measured: CPU model and SIMD flags, cores, sgemm GFLOP/s
   (Paddle's matmul on all cores), single-thread memory read GB/s (numpy).
4. For each type: prefill as ``llama-bench -p 512 -n 0`` against ``fdx bench
   throughput --num-requests 1 --input-len 512 --output-len 1``; for each
   batch size B, ``llama-batched-bench -npp I -ntg O -npl B`` against ``fdx
   bench throughput --num-requests B --input-len I --output-len O``, the
   sides alternating, each in its own process, with its peak resident memory.
5. Serving: ``fdx bench serve --token-ids`` against ``llama-server -np C``
   and against ``fdx serve``, both on the first type's file, one after the other.

Figures are reported, never asserted. Not run in CI: it takes minutes.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:      # its sibling module, run as a script or loaded
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import fdx_peer_models as peer_models  # noqa: E402

from fdx.core.host import available_cores, cache_root, cpu_flags, cpu_id, cpu_model  # noqa: E402

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
TARGETS = ("llama-batched-bench", "llama-bench", "llama-server", "llama-quantize", "llama-perplexity")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DBUILD_SHARED_LIBS=OFF")
DEFAULT_BATCH_SIZES = (1, 8, 32, 64)


class PeerError(Exception):
    """A failure the user can act on: printed as one line, no traceback."""


_QUIET = False


def _say(msg: str) -> None:
    if not _QUIET:
        print(f"[fdx bench peers] {msg}", file=sys.stderr, flush=True)


# --- where things are cached -----------------------------------------------------------

def peers_root(root: Path | None = None) -> Path:
    """Where builds, models and run logs go: root/peers when given (tests), else
    $FDX_PEERS_CACHE, else $FDX_CACHE_DIR/peers, else ~/.cache/fdx/peers."""
    if root is not None:
        return root / "peers"
    env = os.environ.get("FDX_PEERS_CACHE")
    return Path(env) if env else cache_root() / "peers"


def _cpu_hash() -> str:
    return hashlib.sha256(cpu_id().encode()).hexdigest()[:12]


def peer_dir(root: Path | None = None) -> Path:
    return peers_root(root) / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{_cpu_hash()}"


def ik_dir(src: Path, root: Path | None = None) -> Path:
    """ik_llama.cpp's build of the source tree at src (keyed by its path; cmake rebuilds what changed)."""
    h = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:8]
    return peers_root(root) / f"ik_llama.cpp-{h}-{_cpu_hash()}"


# --- building the peers ----------------------------------------------------------------
def obtain_sdist(path: str | None, dest: Path) -> Path:
    """The llama-cpp-python sdist: the given file, else a cached copy, else pip download."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise PeerError(f"--llama-sdist {path}: no such file")
        return p
    cached = dest / SDIST_NAME
    if cached.is_file():
        return cached
    dest.mkdir(parents=True, exist_ok=True)
    _say(f"downloading the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist with pip into {dest}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(dest)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0 or not cached.is_file():
        last = (out.stderr or out.stdout).strip().splitlines()[-1:] or ["no output"]
        raise PeerError(f"pip could not download llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} ({last[0]}); "
                        f"download {SDIST_NAME} yourself and pass --llama-sdist PATH")
    return cached


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """vendor/llama.cpp of the sdist, unpacked to dest (once)."""
    if (dest / "CMakeLists.txt").is_file():
        return dest
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}/vendor/llama.cpp/"
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and len(m.name) > len(prefix):
                    m.name = m.name[len(prefix):]
                    members.append(m)
            if not members:
                raise PeerError(f"{sdist} holds no {prefix}: is it the llama-cpp-python "
                                f"{LLAMA_CPP_PYTHON_VERSION} sdist?")
            tar.extractall(tmp, members=members, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise PeerError(f"cannot unpack {sdist}: {e}") from None
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")
_MAKE_STEP = re.compile(r"^\[\s*(\d+)%\]")


def _run_logged(cmd: list[str], log, what: str, progress: bool) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    # its own process group: an interrupted build stops cmake, ninja and the compilers together
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    shown = -10
    try:
        for line in proc.stdout:
            log.write(line)
            log.flush()                     # the log shows where a long build is
            m = _NINJA_STEP.match(line)
            pct = 100 * int(m[1]) // max(int(m[2]), 1) if m else None
            if m is None and (m := _MAKE_STEP.match(line)):
                pct = int(m[1])
            if progress and pct is not None and pct >= shown + 10:
                shown = pct - pct % 10
                _say(f"{what}: {pct}%")
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.flush()
    if rc != 0:
        raise PeerError(f"{what} failed (exit code {rc}); the log is {log.name}")


def _need_build_tools(what: str) -> None:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if shutil.which("c++") is None and shutil.which("g++"):
        missing.remove("c++")
    if missing:
        raise PeerError(f"building {what} needs {' and '.join(missing)} on PATH "
                        f"(for example: apt-get install cmake g++)")


def _built(d: Path) -> set[str]:
    """The targets a finished build of d made (its build.ok stamp lists them)."""
    try:
        return set((d / "build.ok").read_text().split("\n")[0].split())
    except OSError:
        return set()


def _build(d: Path, src: Path, flags: tuple[str, ...], targets: tuple[str, ...], what: str,
           jobs: int | None, progress: bool) -> dict[str, Path]:
    """cmake configure (once) and build of targets in d/build; their paths. The
    build.ok stamp names the targets built, so a cached build skips even ninja's check."""
    bins = {t: d / "build" / "bin" / t for t in targets}
    if set(targets) <= _built(d) and all(p.is_file() for p in bins.values()):
        return bins
    _need_build_tools(what)
    d.mkdir(parents=True, exist_ok=True)
    jobs = jobs or available_cores()
    log_path = d / "build.log"
    _say(f"building {', '.join(targets)} of {what} from {src} with -j{jobs} (once, minutes; log: {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        if not (d / "build" / "CMakeCache.txt").is_file():
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run_logged(["cmake", "-S", str(src), "-B", str(d / "build"), *gen, *flags], log,
                        f"configuring {what} (cmake)", progress)
        _run_logged(["cmake", "--build", str(d / "build"), f"-j{jobs}", "--target", *targets], log,
                    f"building {what}", progress)
    absent = [t for t, p in bins.items() if not p.is_file()]
    if absent:
        raise PeerError(f"the {what} build finished without {', '.join(absent)}; the log is {log_path}")
    done = sorted(_built(d) | set(targets))
    (d / "build.ok").write_text(f"{' '.join(done)}\nbuilt by fdx bench peers\n")
    _say(f"{what} built in {time.perf_counter() - t0:.0f} s")
    return bins


def build_llama_cpp(sdist: str | None = None, root: Path | None = None, jobs: int | None = None,
                    progress: bool = True, targets: tuple[str, ...] = TARGETS) -> dict[str, Path]:
    """Build llama.cpp's targets (default: all of TARGETS) once from the llama-cpp-python sdist; their paths."""
    d = peer_dir(root)
    if not (set(targets) <= _built(d) and all((d / "build" / "bin" / t).is_file() for t in targets)):
        _need_build_tools("llama.cpp")          # before the sdist is fetched
        if not (d / "src" / "CMakeLists.txt").is_file():
            extract_llama_cpp(obtain_sdist(sdist, peers_root(root)), d / "src")
    return _build(d, d / "src", CMAKE_FLAGS, targets, "llama.cpp", jobs, progress)


def llama_cpp_src(root: Path | None = None) -> Path:
    """The llama.cpp sources the peer was built from (convert_hf_to_gguf.py and gguf-py are there)."""
    return peer_dir(root) / "src"


IK_TARGETS = ("llama-bench", "llama-batched-bench")
IK_CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
                  "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                  "-DGGML_IQK_FA_ALL_QUANTS=OFF")      # every KV type's flash attention: a much longer build
IK_ENV = "FDX_IK_LLAMA_SRC"


def ik_source(arg: str | None) -> Path | None:
    """--ik-llama-src, else $FDX_IK_LLAMA_SRC, else None (no ik_llama.cpp side); checked, never cloned."""
    text = arg or os.environ.get(IK_ENV)
    if not text:
        return None
    src = Path(text).expanduser()
    where = "--ik-llama-src" if arg else IK_ENV
    if not (src / "CMakeLists.txt").is_file() or not (src / "ggml" / "src").is_dir():
        raise PeerError(f"{where} {text}: not an ik_llama.cpp source tree (no CMakeLists.txt and ggml/src); "
                        f"give a checkout of https://github.com/ikawrakow/ik_llama.cpp (fdx does not clone it)")
    return src


def build_ik_llama(src: Path, root: Path | None = None, jobs: int | None = None,
                   progress: bool = True) -> dict[str, Path]:
    """ik_llama.cpp's llama-bench and llama-batched-bench, built once from src."""
    return _build(ik_dir(src, root), src, IK_CMAKE_FLAGS, IK_TARGETS, "ik_llama.cpp", jobs, progress)


def make_f32(quantize: Path, model: Path, root: Path | None = None) -> Path:
    """The model as an F32 GGUF (llama-quantize --allow-requantize ... F32), made once."""
    out_dir = peers_root(root) / "models"
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = model.name[:-5] if model.name.lower().endswith(".gguf") else model.name
    stem = re.sub(r"\.(I?Q\d\w*|B?F16|F32)$", "", stem, flags=re.IGNORECASE)    # SmolLM2-135M-Instruct.Q4_1
    out = out_dir / f"{model.stat().st_size}" / f"{stem}.F32.gguf"           # keyed by the source's size
    out.parent.mkdir(exist_ok=True)
    if out.is_file():
        return out
    return _quantize(quantize, model, out, "F32", "--allow-requantize")


def _quantize(quantize: Path, src: Path, out: Path, kind: str, *flags: str) -> Path:
    """``llama-quantize [flags] src out kind`` into a .partial file renamed
    to ``out`` once whole; a failure is a PeerError with its error line."""
    _say(f"making the {kind} GGUF {out}")
    tmp = out.with_suffix(".partial")
    r = subprocess.run([str(quantize), *flags, str(src), str(tmp), kind], capture_output=True, text=True)
    if r.returncode != 0 or not tmp.is_file():
        raise PeerError(f"llama-quantize could not make a{'n' if kind == 'F32' else ''} {kind} GGUF of {src}: "
                        f"{_tail(r.stderr or r.stdout)}")
    tmp.rename(out)
    return out


QUANT_TYPES = ("F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K")
# llama-quantize's name -> what a GGUF file made with it says in general.file_type (llama_ftype)
_FILE_TYPES = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q6_K": 18,
               "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17}


def quant_types(text: str) -> list[str]:
    """``--quant``'s comma-separated GGUF types, checked and upper-cased."""
    names = [x.strip().upper() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in QUANT_TYPES]
    if not names or bad:
        raise ValueError(f"--quant expects comma-separated GGUF types of {', '.join(QUANT_TYPES)}, got {text!r}")
    return list(dict.fromkeys(names))


def gguf_file_type(model: Path) -> int | None:
    """general.file_type of a GGUF file (llama_ftype), or None when it does not say."""
    from fdx.model_io.gguf_file import read_gguf
    field = read_gguf(model).fields.get("general.file_type")
    return int(field.contents()) if field is not None else None


def make_quant(quantize: Path, model: Path, kind: str, root: Path | None = None) -> Path:
    """The model as a GGUF of type ``kind``: the file itself when it already is
    one, else ``llama-quantize`` of its F32 GGUF (made once, cached beside it)."""
    if kind == "F32":
        return make_f32(quantize, model, root)
    if gguf_file_type(model) == _FILE_TYPES[kind]:
        return model
    f32 = make_f32(quantize, model, root)
    out = f32.with_name(f32.name.replace(".F32.gguf", f".{kind}.gguf"))
    if out.is_file():
        return out
    return _quantize(quantize, f32, out, kind)


def shape_dir(name: str, seed: int, dtype: str, root: Path | None = None) -> Path:
    return peers_root(root) / "models" / f"shape-{name}-seed{seed}-{dtype}"


def make_shape_gguf(name: str, src: Path, tokenizer_gguf: Path, seed: int = 0, dtype: str = "f16",
                    root: Path | None = None) -> Path:
    """The random-weight checkpoint of shape ``name`` as a GGUF in dtype (F16
    or BF16): written by fdx_peer_models, converted by the sources'
    convert_hf_to_gguf.py, cached. The safetensors file is removed once
    converted (the GGUF holds the same values)."""
    peer_models.shape(name)                                     # a bad name first, before anything is written
    d = shape_dir(name, seed, dtype, root)
    out = d / f"{name}.{dtype.upper()}.gguf"
    if out.is_file():
        return out
    script = src / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise PeerError(f"{src} has no convert_hf_to_gguf.py: the llama.cpp sources are incomplete")
    missing = peer_models.missing_convert_deps()
    if missing:
        raise PeerError(f"llama.cpp's convert_hf_to_gguf.py needs the Python modules {', '.join(missing)}, "
                        f"which {sys.executable} cannot import; install them (pip install {' '.join(missing)}) "
                        f"or pass --model FILE.gguf")
    sh = peer_models.shape(name)
    _say(f"writing a random-weight {name} checkpoint ({sh.num_parameters() / 1e9:.2f}B parameters, {dtype}, "
         f"seed {seed}, the embedded SmolLM2's tokenizer) in {d / 'hf'}")
    hf = peer_models.write_checkpoint(d / "hf", name, tokenizer_gguf, seed, dtype)
    _say(f"converting it with {script.name} --outtype {dtype}")
    tmp = out.with_name(out.name + ".partial")
    log = d / "convert.log"
    stub = peer_models.sentencepiece_stub(d / "stub")
    if stub:
        _say(f"sentencepiece is not installed: a stand-in in {stub} lets the converter reach the tokenizer.json")
    rc, _, err, rss, _ = run_measured(peer_models.convert_command(src, hf, tmp, dtype), log,
                                   env=peer_models.convert_env(stub))
    if rc != 0 or not tmp.is_file():
        raise PeerError(f"convert_hf_to_gguf.py failed on the {name} checkpoint (exit code {rc}): {_tail(err)}; "
                        f"the log is {log}")
    tmp.rename(out)
    _say(f"converted ({out.stat().st_size / 1e9:.2f} GB, converter peak resident {rss:.0f} MB)")
    (hf / "model.safetensors").unlink(missing_ok=True)
    return out


def make_shape_quant(quantize: Path, source: Path, kind: str) -> Path:
    """A type of the shape's F16/BF16 GGUF, quantized from it (not requantized), cached beside it."""
    out = source.with_name(re.sub(r"\.B?F16\.gguf$", f".{kind}.gguf", source.name))
    if out.is_file():
        return out
    return _quantize(quantize, source, out, kind)


def source_note(model: Path, shape: str | None, seed: int, dtype: str) -> str:
    """What the compared files are made from, for the report."""
    if shape:
        return (f"random weights of the {shape} shape (seed {seed}, the embedded SmolLM2 tokenizer), written as "
                f"{dtype} safetensors, converted by llama.cpp's convert_hf_to_gguf.py --outtype {dtype}, each type "
                f"made by llama-quantize from that {dtype.upper()} GGUF")
    ft = gguf_file_type(model)
    name = next((k for k, v in _FILE_TYPES.items() if v == ft), None)
    if name in (None, "F32"):
        return f"{model.name}, each type made by llama-quantize from its F32 GGUF"
    return (f"{model.name} ({name}): its F32 GGUF made by llama-quantize --allow-requantize (so it holds the "
            f"{name} values), each other type quantized from that F32 file")


def fdx_quant_args(kind: str) -> list[str]:
    """fdx's weight format for a file of type ``kind``: each tensor kept in its
    own type (auto), or float32 (none) for the F32 file."""
    return ["--quantization", "none" if kind == "F32" else "auto"]


# --- the machine -----------------------------------------------------------------------

def sgemm_gflops(sizes=(1024, 2048), repeats: int = 3, threads: int | None = None) -> float:
    """Best fp32 square-matmul rate of Paddle on `threads` (default: all) cores, GFLOP/s.

    Each product is checked against numpy on a few rows, so a wrong or
    lazy matmul cannot report a rate."""
    import numpy as np
    import paddle
    paddle.base.core.set_num_threads(threads or available_cores())
    best = 0.0
    rng = np.random.default_rng(0)
    for n in sizes:
        a_np = rng.standard_normal((n, n), dtype=np.float32)
        b_np = rng.standard_normal((n, n), dtype=np.float32)
        a, b = paddle.to_tensor(a_np), paddle.to_tensor(b_np)
        c = paddle.matmul(a, b)                      # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            c = paddle.matmul(a, b)
            c_np = c.numpy()                         # forces completion
            dt = time.perf_counter() - t0
            best = max(best, 2.0 * n ** 3 / dt / 1e9)
        rows = c_np[:4]
        if not np.allclose(rows, a_np[:4] @ b_np, rtol=1e-3, atol=1e-2 * math.sqrt(n)):
            raise RuntimeError("paddle.matmul disagrees with numpy: the sgemm probe is void")
    return best


def memory_read_gbps(mib: int = 512, repeats: int = 3) -> float:
    """Best single-thread read rate over a `mib` MiB float64 array, GB/s.

    numpy's max (SIMD, one thread) keeps up with memory where its pairwise
    sum does not; the result is checked, so a skipped read cannot report a rate."""
    import numpy as np
    a = np.ones(mib * (1 << 20) // 8)
    a[-1] = 2.0
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = a.max()
        dt = time.perf_counter() - t0
        if m != 2.0:
            raise RuntimeError("numpy's max is wrong: the memory probe is void")
        best = max(best, a.nbytes / dt / 1e9)
    return best


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8")


def machine_info(threads: int, quick: bool = False) -> dict:
    """What the report is headed by. quick: smaller probes (for tests)."""
    flags = set(cpu_flags())
    return {
        "cpu": cpu_model(), "cores": available_cores(), "threads": threads,
        "simd": [f for f in SIMD_FLAGS if f in flags],
        "sgemm_gflops": sgemm_gflops((256, 512) if quick else (1024, 2048), threads=threads),
        "memory_read_gbps": memory_read_gbps(64 if quick else 512),
        "mkl_debug_cpu_type": os.environ.get("MKL_DEBUG_CPU_TYPE"),   # fdx sets 7 at import: MKL's AVX2 path
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def format_machine(m: dict) -> str:
    load = f", load average {m['load_avg_1m']:.1f} at the start" if m.get("load_avg_1m") is not None else ""
    simd = f" [{' '.join(m['simd']) or 'no AVX2'}]" if "simd" in m else ""
    return (f"{m['cpu']}{simd}, {m['cores']} cores ({m['threads']} threads used), sgemm {m['sgemm_gflops']:.0f} "
            f"GFLOP/s, memory read {m['memory_read_gbps']:.1f} GB/s (1 thread){load}")


# --- llama-batched-bench and fdx bench throughput --------------------------------------

_BB_COLUMNS = {"PP": "pp", "TG": "tg", "B": "b", "N_KV": "n_kv", "T_PP s": "t_pp", "S_PP t/s": "s_pp",
               "T_TG s": "t_tg", "S_TG t/s": "s_tg", "T s": "t", "S t/s": "s"}


def parse_batched_bench(text: str) -> list[dict]:
    """The rows of llama-batched-bench's markdown table, keyed pp, tg, b, n_kv,
    t_pp, s_pp, t_tg, s_tg, t, s (seconds and tokens/s, as it prints them)."""
    header, rows = None, []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if "S_PP t/s" in cells and "S t/s" in cells:
                header = cells
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        if len(cells) != len(header):
            continue
        row = {}
        for name, cell in zip(header, cells):
            if name in _BB_COLUMNS:
                key = _BB_COLUMNS[name]
                row[key] = int(cell) if key in ("pp", "tg", "b", "n_kv") else float(cell)
        rows.append(row)
    if header is None or not rows:
        raise PeerError("llama-batched-bench printed no result table")
    return rows


def _tail(text: str) -> str:
    """The last line that says error or failed, else the last line (a crash ends in a backtrace)."""
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    said = [x for x in lines if re.search(r"error|failed", x, re.IGNORECASE)]
    return (said or lines or ["no output"])[-1]


# Runs the command given after it and writes its peak resident KiB and its CPU
# seconds (user + system, threads summed) to the file given first. A child forked from this tool would count the tool's own memory
# (Paddle, from the sgemm probe) until its exec; this small interpreter spawns
# it with posix_spawn (vfork: the child shares the wrapper's ~10 MB until exec).
_RSS_WRAPPER = """import os, sys
out, cmd = sys.argv[1], sys.argv[2:]
pid = os.posix_spawnp(cmd[0], cmd, os.environ)
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    f.write(f"{usage.ru_maxrss} {usage.ru_utime + usage.ru_stime}")
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


def run_measured(cmd: list[str], log_path: Path, env: dict | None = None,
                 cwd: Path | None = None) -> tuple[int, str, str, float, float]:
    """Run cmd to completion: (exit code, stdout, stderr, peak resident MB of
    its process, its CPU seconds), from wait4's rusage in a small wrapper;
    the command and its output go to log_path. CPU seconds well above threads
    x wall seconds of work show threads spinning (llama.cpp's barriers wait
    busily for a thread the OS has descheduled on a loaded machine). cwd: where it runs
    (ik_llama.cpp's tools write a llama.log into theirs)."""
    out_path, err_path = log_path.with_suffix(".stdout"), log_path.with_suffix(".stderr")
    rss_path = log_path.with_suffix(".maxrss")
    rss_path.unlink(missing_ok=True)
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _RSS_WRAPPER, str(rss_path), *cmd],
                                stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                cwd=cwd)
        try:
            rc = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    log_path.write_text(f"$ {' '.join(cmd)}\n{stdout}\n{stderr}")
    out_path.unlink()
    err_path.unlink()
    try:
        kib, cpu = (float(x) for x in rss_path.read_text().split())     # Linux: ru_maxrss in KiB
        rss_path.unlink()
    except (OSError, ValueError):
        kib = cpu = float("nan")
    return rc, stdout, stderr, kib / 1024, cpu


def parse_llama_bench_json(text: str, n_prompt: int) -> float:
    """tok/s of the prompt-only test (n_prompt tokens, n_gen 0) in ``llama-bench -o json``'s output:
    its best repetition (samples_ts), as fdx's side reports its best run, else its average."""
    start = text.find("[")
    try:
        rows = json.JSONDecoder().raw_decode(text[start:])[0] if start >= 0 else []
    except ValueError:
        rows = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and row.get("n_prompt") == n_prompt and row.get("n_gen") == 0:
            return float(max(row.get("samples_ts") or [row["avg_ts"]]))
    raise PeerError(f"llama-bench printed no pp{n_prompt} result")


# llama.cpp reads the whole file into memory at load (its load mode "none", as --no-mmap did), as
# ik_llama.cpp does with -rtr and as fdx does: with its default mmap, a mixture of experts' weights
# are first touched (and, out of the page cache, read from disk) inside the timed decode
READ_AT_LOAD = ("-lm", "none")


def llama_bench_command(binary: Path, model: Path, n_prompt: int, threads: int, repeats: int,
                        ik: bool = False, mmap: bool = False) -> list[str]:
    """``llama-bench -p N -n 0``: prompt processing of N tokens in one batch, as users quote it
    (pp512); ik_llama.cpp with run-time repack (-rtr 1, which reads the file at load);
    llama.cpp reading the file at load unless ``mmap``."""
    cmd = [str(binary), "-m", str(model), "-p", str(n_prompt), "-n", "0", "-t", str(threads),
           "-r", str(repeats), "-o", "json"]
    if ik:
        return cmd + ["-rtr", "1"]
    return cmd + ([] if mmap else list(READ_AT_LOAD))


def run_llama_bench(binary: Path, model: Path, n_prompt: int, threads: int, repeats: int, log_dir: Path,
                    tag: str, ik: bool = False, mmap: bool = False) -> dict:
    name = "ik-llama-bench" if ik else "llama-bench"
    cmd = llama_bench_command(binary.resolve(), model.resolve(), n_prompt, threads, repeats, ik, mmap)  # run in log_dir
    rc, out, err, rss, cpu = run_measured(cmd, log_dir / f"{name}-{tag}.log", cwd=log_dir)
    if rc != 0:
        raise PeerError(f"{name} -p {n_prompt} failed with exit code {rc}: {_tail(err)}")
    return {"prompt_tps": parse_llama_bench_json(out, n_prompt), "peak_rss_mb": rss, "cpu_s": cpu}


def batched_bench_command(binary: Path, model: Path, batch: int, input_len: int, output_len: int,
                          threads: int, ik: bool = False, mmap: bool = False) -> list[str]:
    ctx = max(batch * (input_len + output_len), 256)      # its warm-up decodes 16 tokens in one batch
    cmd = [str(binary), "-m", str(model), "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(batch),
           "-t", str(threads), "-tb", str(threads), "-c", str(ctx)]
    if ik:
        return cmd + ["-rtr"]
    return cmd + ([] if mmap else list(READ_AT_LOAD))


def run_llama_batched(binary: Path, model: Path, batch: int, input_len: int, output_len: int, threads: int,
                      log_dir: Path, tag: str = "", ik: bool = False, mmap: bool = False) -> dict:
    name = "ik-llama-batched-bench" if ik else "llama-batched-bench"
    cmd = batched_bench_command(binary.resolve(), model.resolve(), batch, input_len, output_len, threads, ik, mmap)
    rc, out, err, rss, cpu = run_measured(cmd, log_dir / f"{name}-{tag or f'B{batch}'}.log", cwd=log_dir)
    if rc != 0:
        raise PeerError(f"{name} (B={batch}) failed with exit code {rc}: {_tail(err)}")
    return {**llama_figures(parse_batched_bench(out + "\n" + err)[-1]), "peak_rss_mb": rss, "cpu_s": cpu}


def llama_figures(row: dict) -> dict:
    """A llama-batched-bench row as the report's figures: prompt = S_PP, decode = S_TG, all = S."""
    return {"prompt_tps": row["s_pp"], "decode_tps": row["s_tg"], "all_tps": row["s"], "total_s": row["t"],
            "raw": row}


def _fdx_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fdx.entrypoints.cli", *args]


def _json_out(stdout: str) -> dict:
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON in the output")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]      # whatever follows the object is ignored


def fdx_throughput_command(model: Path, batch: int, input_len: int, output_len: int, threads: int,
                           extra: list[str]) -> list[str]:
    # a context of the run's length, as llama-batched-bench's -c: at the model's own (8192 at 1.7B) the
    # default KV cache (a tenth of the memory) cannot hold one float32 sequence, and fdx refuses
    cmd = _fdx_cmd("bench", "throughput", "--model", str(model), "--num-requests", str(batch),
                   "--input-len", str(input_len), "--output-len", str(output_len), "--json", "--quiet",
                   "--num-threads", str(threads), "--max-model-len", str(max(input_len + output_len, 256)), *extra)
    if batch > 64:                              # fdx's default max_num_seqs
        cmd += ["--max-num-seqs", str(batch)]
    return cmd


def run_fdx_throughput(model: Path, batch: int, input_len: int, output_len: int, threads: int,
                       log_dir: Path, extra: list[str], tag: str = "") -> dict:
    cmd = fdx_throughput_command(model, batch, input_len, output_len, threads, extra)
    rc, out, err, rss, cpu = run_measured(cmd, log_dir / f"fdx-throughput-{tag or f'B{batch}'}.log")
    if rc != 0:
        raise PeerError(f"fdx bench throughput (B={batch}) failed with exit code {rc}: {_tail(err)}")
    try:
        d = _json_out(out)
    except ValueError as e:
        raise PeerError(f"fdx bench throughput (B={batch}) printed no JSON ({e})") from None
    return {**fdx_figures(d), "peak_rss_mb": rss, "cpu_s": cpu}


def fdx_figures(d: dict) -> dict:
    """fdx bench throughput's JSON as the report's figures: prompt = tokens of the steps
    with prefill / their time, decode = tokens of decode-only steps / their time,
    all = (prompt + output tokens) / wall time, as llama-batched-bench's S."""
    return {"prompt_tps": d["prompt_tokens_per_s"], "decode_tps": d["decode_tokens_per_s"],
            "all_tps": d["overall_tokens_per_s"], "total_s": d["total_time_s"], "raw": d}


def best_run(runs: list[dict], key: str = "all_tps") -> dict:
    """Of repeated runs of one side, the one with the best ``key`` tok/s (the least
    disturbed on a shared machine), with every run's figure beside it (``<key>_runs``)."""
    best = dict(max(runs, key=lambda r: r[key]))
    best[f"{key}_runs"] = [r[key] for r in runs]
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def batch_row(batch: int, llama: dict, fdx: dict, ik: dict | None = None) -> dict:
    """One table row: each side's prompt, decode and all tok/s and peak resident MB,
    and fdx / llama.cpp (ratio) and fdx / ik_llama.cpp (ratio_ik) ratios."""
    keys = ("prompt_tps", "decode_tps", "all_tps", "total_s", "all_tps_runs", "peak_rss_mb", "cpu_s")
    row = {"batch": batch, "llama": {k: llama[k] for k in keys if k in llama},
           "fdx": {k: fdx[k] for k in keys if k in fdx}}
    row["ratio"] = {k: _ratio(fdx[k], llama[k]) for k in ("prompt_tps", "decode_tps", "all_tps")}
    if (fdx.get("raw") or {}).get("expert_load"):        # a MoE model: fdx's expert load balance over the run
        row["expert_load"] = fdx["raw"]["expert_load"]
    if ik is not None:
        row["ik"] = {k: ik[k] for k in keys if k in ik}
        row["ratio_ik"] = {k: _ratio(fdx[k], ik[k]) for k in ("prompt_tps", "decode_tps", "all_tps")}
    return row


def prefill_row(n_prompt: int, llama: dict, fdx: dict, ik: dict | None = None) -> dict:
    """The llama-bench -p N figures beside fdx's one-request prefill of N tokens."""
    row = {"n_prompt": n_prompt, "llama": llama, "fdx": fdx, "ratio": _ratio(fdx["prompt_tps"], llama["prompt_tps"])}
    if ik is not None:
        row["ik"] = ik
        row["ratio_ik"] = _ratio(fdx["prompt_tps"], ik["prompt_tps"])
    return row


# --- serving ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class ManagedServer:
    """A server process in its own session (process group), stopped with its
    children on exit, error or Ctrl-C: SIGTERM to the group, then SIGKILL."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.base_url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "ManagedServer":
        if _port_open(self.port):
            raise PeerError(f"port {self.port} is already taken; cannot start {self.name}")
        self._log = open(self.log_path, "w")
        self._log.write(f"$ {' '.join(self.cmd)}\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.env)
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 (both llama-server and fdx serve answer 503 while loading)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PeerError(f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                                f"the log is {self.log_path}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise PeerError(f"{self.name} was not ready after {timeout:.0f} s; the log is {self.log_path}")

    def stop(self) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid                       # start_new_session: the group is the one we started
        for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; children of the group may linger a moment
            end = time.monotonic() + wait
            while time.monotonic() < end and _group_alive(pgid):
                time.sleep(0.1)
            if not _group_alive(pgid):
                break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        end = time.monotonic() + 10
        while time.monotonic() < end and _port_open(self.port):
            time.sleep(0.2)
        self._log.close()
        self.proc = None

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def run_serve_bench(base_url: str, num_requests: int, concurrency: int, input_len: int, output_len: int,
                    log_path: Path) -> dict:
    cmd = _fdx_cmd("bench", "serve", "--base-url", base_url, "--token-ids", "--num-requests", str(num_requests),
                   "--concurrency", str(concurrency), "--input-len", str(input_len), "--output-len",
                   str(output_len), "--json", "--no-progress")
    env = {k: v for k, v in os.environ.items() if k not in ("FDX_API_KEY", "OPENAI_API_KEY")}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log_path.write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    try:
        d = _json_out(r.stdout)
    except ValueError:
        raise PeerError(f"fdx bench serve against {base_url} failed: {_tail(r.stderr)}") from None
    if d["failed"]:
        raise PeerError(f"fdx bench serve against {base_url}: {d['failed']} requests failed: "
                        f"{(d['errors'] or ['?'])[0]}")
    return {"output_tps": d["output_throughput"], "median_ttft_ms": d["median_ttft_ms"],
            "median_tpot_ms": d["median_tpot_ms"], "duration_s": d["duration"],
            "output_tokens": d["total_output_tokens"]}


def serve_row(llama: dict, fdx: dict) -> dict:
    return {"llama": llama, "fdx": fdx,
            "ratio": {k: _ratio(fdx[k], llama[k]) for k in ("output_tps", "median_ttft_ms", "median_tpot_ms")}}


# --- the report ------------------------------------------------------------------------

def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _r(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def format_table(report: dict) -> str:
    types = report.get("types") or [{"type": "F32", "model": report["model"], "batches": report["batches"]}]
    ik = report.get("ik_llama_cpp")
    lines = [f"fdx bench peers: fdx beside llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s vendor copy)"
             + (f" and ik_llama.cpp ({ik}, run-time repack -rtr)" if ik else "")
             + f", {report['input_len']} prompt + {report['output_len']} output tokens per sequence",
             f"machine: {format_machine(report['machine'])}"]
    if report.get("source"):
        lines.append(f"files: {report['source']}")
    for t in types:
        lines += ["", f"{t['type']}: {t['model']} (fdx {' '.join(t.get('fdx_args') or fdx_quant_args(t['type']))})"]
        if t.get("prefill"):
            lines += _prefill_table(t["prefill"])
        if t.get("batches"):
            lines += _batch_table(t["batches"])
    s = report.get("serve")
    if s:
        ll, fx, ra = s["llama"], s["fdx"], s["ratio"]
        lines += ["", f"serving: {s['num_requests']} streaming requests at concurrency {s['concurrency']}, "
                      f"llama-server -np {s['concurrency']} vs fdx serve",
                  "| server | output tok/s | median TTFT ms | median TPOT ms |", "|---|---|---|---|",
                  f"| llama-server | {_f(ll['output_tps'])} | {_f(ll['median_ttft_ms'], 0)} | "
                  f"{_f(ll['median_tpot_ms'], 0)} |",
                  f"| fdx serve | {_f(fx['output_tps'])} | {_f(fx['median_ttft_ms'], 0)} | "
                  f"{_f(fx['median_tpot_ms'], 0)} |",
                  f"| fdx / llama | {_r(ra['output_tps'])} | {_r(ra['median_ttft_ms'])} | "
                  f"{_r(ra['median_tpot_ms'])} |"]
    return "\n".join(lines)


def _prefill_table(p: dict) -> list[str]:
    n = p["n_prompt"]
    lines = [f"prefill of {n} tokens: llama-bench -p {n} -n 0 vs fdx bench throughput --num-requests 1 "
             f"--input-len {n} --output-len 1",
             "| side | prompt tok/s | fdx / side | peak RSS MB |", "|---|---|---|---|",
             f"| llama.cpp | {_f(p['llama']['prompt_tps'])} | {_r(p['ratio'])} | {_mb(p['llama'].get('peak_rss_mb'))} |"]
    if "ik" in p:
        lines.append(f"| ik_llama.cpp -rtr | {_f(p['ik']['prompt_tps'])} | {_r(p['ratio_ik'])} | "
                     f"{_mb(p['ik'].get('peak_rss_mb'))} |")
    lines.append(f"| fdx | {_f(p['fdx']['prompt_tps'])} | - | {_mb(p['fdx'].get('peak_rss_mb'))} |")
    return lines


def _batch_table(batches: list[dict]) -> list[str]:
    ik = any("ik" in row for row in batches)
    peers_ = ("llama", "ik") if ik else ("llama",)
    label = {"llama": "llama", "ik": "ik"}
    head = ["B"]
    for what in ("prompt", "decode", "all"):
        head += [f"{label[p]} {what}" for p in peers_] + [f"fdx {what}"] + [f"fdx/{label[p]}" for p in peers_]
    head.append("peak RSS MB " + " / ".join([*(label[p] for p in peers_), "fdx"]))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in batches:
        cells = [str(row["batch"])]
        for k in ("prompt_tps", "decode_tps", "all_tps"):
            cells += [_f(row[p][k]) for p in peers_] + [_f(row["fdx"][k])]
            cells += [_r(row["ratio" if p == "llama" else "ratio_ik"][k]) for p in peers_]
        cells.append(" / ".join(_mb(row[p].get("peak_rss_mb")) for p in (*peers_, "fdx")))
        lines.append("| " + " | ".join(cells) + " |")
    for row in batches:
        el = row.get("expert_load")
        if el:
            lines.append(f"expert load at B={row['batch']} (fdx's count): busiest expert {el['max_over_mean']:.2f}x "
                         f"the mean (layer average {el['mean_max_over_mean']:.2f}x) over {el['moe_layers']} MoE "
                         f"layers of {el['experts']} experts, {el['idle_experts']} (layer, expert) pairs idle")
    lines.append("(tok/s; fdx/x = fdx / that peer; prompt = S_PP vs prefill steps, decode = S_TG vs decode-only "
                 "steps, all = (prompt + output) / wall: S vs overall_tokens_per_s"
                 + ("; ik = ik_llama.cpp with -rtr" if ik else "") + ")")
    for row in batches:
        ll, fx = row["llama"].get("all_tps_runs", []), row["fdx"].get("all_tps_runs", [])
        if len(ll) > 1 or len(fx) > 1:
            lines.append(f"B={row['batch']}: best of {len(ll)} runs each; all tok/s of every run: llama.cpp "
                         f"{', '.join(f'{x:.1f}' for x in ll)}; fdx {', '.join(f'{x:.1f}' for x in fx)}")
    return lines


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = report["batches"]
    bs = [r["batch"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    x = range(len(bs))
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["llama"]["all_tps"] for r in rows], w, label="llama.cpp (batched-bench S)")
    ax.bar([i + w / 2 for i in x], [r["fdx"]["all_tps"] for r in rows], w, label="fdx (bench throughput)")
    for i, r in enumerate(rows):
        if r["ratio"]["all_tps"] is not None:
            top = max(r["llama"]["all_tps"], r["fdx"]["all_tps"])
            ax.annotate(f"fdx/llama {r['ratio']['all_tps']:.2f}x", (i, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [str(b) for b in bs])
    ax.set_xlabel("sequences in the batch (B)")
    ax.set_ylabel("all tokens / wall time (tok/s)")
    m = report["machine"]
    kind = (report.get("types") or [{"type": "F32"}])[0]["type"]
    ax.set_title(f"{kind}, {report['input_len']}+{report['output_len']} tokens; {m['cpu']}, {m['threads']} threads",
                 fontsize=9)
    ax.set_ylim(0, 1.3 * max(max(r["llama"]["all_tps"], r["fdx"]["all_tps"]) for r in rows))
    ax.legend(loc="upper center", ncol=2, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the command -----------------------------------------------------------------------

DEFAULT_QUANT = "Q4_K_M,Q4_0,Q4_1,Q8_0,F32"
HELP = "fdx side by side with llama.cpp (and ik_llama.cpp) on this machine (builds them once)"


def build_parser(prog: str = "fdx bench peers") -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(
        prog=prog,
        description="Builds llama.cpp once (cached) from the llama-cpp-python sdist, and ik_llama.cpp from a given "
                    "source tree; makes each --quant type of the model with llama-quantize (from a random-weight "
                    "checkpoint of a named shape with --shape, converted by llama.cpp's convert_hf_to_gguf.py); "
                    "measures the machine; then runs llama-bench -p N against fdx's N-token prefill, "
                    "llama-batched-bench against fdx bench throughput for each batch size, and llama-server "
                    "against fdx serve with fdx bench serve. Takes minutes. See docs/benchmarks.md.")
    src = s.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", default=None,
                     help="a .gguf file; each --quant type is made from its F32 file, made with llama-quantize "
                          "--allow-requantize (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    src.add_argument("--shape", default=None, choices=list(peer_models.SHAPES), metavar="NAME",
                     help="compare on random weights of this real model's shape instead, written, converted and "
                          f"quantized by the tool and cached: {', '.join(peer_models.SHAPES)} (default: none)")
    s.add_argument("--shape-seed", type=int, default=0, help="seed of --shape's random weights (default: %(default)s)")
    s.add_argument("--shape-dtype", default="f16", choices=sorted(peer_models.DTYPES),
                   help="--shape's checkpoint and converted GGUF dtype, the source of each type (default: %(default)s)")
    s.add_argument("--quant", default=DEFAULT_QUANT,
                   help=f"comma-separated GGUF types to compare on, each made with llama-quantize "
                        f"({', '.join(QUANT_TYPES)}); fdx runs each with --quantization auto, F32 with "
                        "none (default: %(default)s)")
    s.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma-separated sequences per batch for llama-batched-bench and fdx bench throughput, "
                        "or none (default: %(default)s)")
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence (default: %(default)s)")
    s.add_argument("--output-len", type=int, default=128, help="generated tokens per sequence (default: %(default)s)")
    s.add_argument("--prefill-len", type=int, default=512,
                   help="llama-bench -p N beside fdx's N-token prefill of one request; 0: none "
                        "(default: %(default)s)")
    s.add_argument("--ik-llama-src", default=None, metavar="PATH",
                   help=f"an ik_llama.cpp source tree to build (once) and compare with, run with -rtr; never "
                        f"cloned (default: ${IK_ENV}, else none)")
    s.add_argument("--threads", type=int, default=None, help="threads for every engine (default: the cores)")
    s.add_argument("--llama-mmap", action="store_true",
                   help="let llama.cpp memory-map the file (its own default) instead of reading it at load as "
                        "fdx and ik_llama.cpp -rtr do; a mixture of experts then reads experts inside the timed "
                        "decode (default: off, llama.cpp runs with -lm none)")
    s.add_argument("--repeats", type=int, default=1,
                   help="runs of each side per batch size, alternating, the best all tok/s of each side reported; "
                        "llama-bench's -r (default: %(default)s)")
    s.add_argument("--skip-serve", action="store_true", help="no serving comparison (default: run it)")
    s.add_argument("--serve-requests", type=int, default=64, help="streaming requests per server (default: %(default)s)")
    s.add_argument("--serve-concurrency", type=int, default=32,
                   help="requests in flight, and llama-server's -np (default: %(default)s)")
    s.add_argument("--llama-sdist", default=None,
                   help=f"path of {SDIST_NAME} (default: the cached copy, else pip download)")
    s.add_argument("--cache-dir", default=None,
                   help="where builds, files and logs are cached (default: $FDX_PEERS_CACHE, else "
                        "$FDX_CACHE_DIR/peers, else ~/.cache/fdx/peers)")
    s.add_argument("--jobs", type=int, default=None, help="parallel compile jobs for the builds (default: the cores)")
    s.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for each server to be ready (default: %(default)s)")
    s.add_argument("--fdx-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for fdx's runs (bench throughput and serve) as --set KEY=VALUE; "
                        "repeatable (default: none)")
    s.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    s.add_argument("--plot", default=None, metavar="OUT.png",
                   help="save all tok/s against batch size, fdx beside llama.cpp; needs matplotlib (default: none)")
    s.add_argument("--quiet", "-q", action="store_true", help="no progress lines (default: off)")
    s.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"], type=str.lower,
                   help="log level of fdx's runs (FDX_LOG_LEVEL; default: $FDX_LOG_LEVEL, else warning: "
                        "they run with --quiet)")
    return s


def main(argv: list[str] | None = None, prog: str = "fdx bench peers") -> int:
    """The command: ``fdx bench peers ARGS`` and ``python scripts/bench_peers/fdx_bench_peers.py ARGS``."""
    args = build_parser(prog).parse_args(argv)
    global _QUIET
    _QUIET = args.quiet
    if args.log_level:
        os.environ["FDX_LOG_LEVEL"] = args.log_level
    try:
        return cmd_bench_peers(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _batch_sizes(text: str) -> list[int]:
    if text.strip().lower() in ("none", "0", ""):
        return []
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes expects comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes expects integers >= 1, got {text!r}")
    return sizes


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_bench_peers(args) -> int:
    sizes = _batch_sizes(args.batch_sizes)
    quant_types(args.quant)
    if min(args.input_len, args.output_len, args.serve_requests, args.serve_concurrency, args.repeats) < 1:
        raise ValueError("--input-len, --output-len, --serve-requests, --serve-concurrency and --repeats must be >= 1")
    if args.prefill_len < 0:
        raise ValueError("--prefill-len must be >= 0 (0: no prefill comparison)")
    if not sizes and not args.prefill_len:
        raise ValueError("--batch-sizes none with --prefill-len 0 leaves nothing to measure")
    if args.plot:
        if not sizes:
            raise ValueError("--plot draws the batch sizes: give --batch-sizes")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("fdx bench peers: --plot needs matplotlib: pip install matplotlib") from None
    if args.cache_dir:
        os.environ["FDX_PEERS_CACHE"] = str(Path(args.cache_dir).expanduser().resolve())
    from fdx.model_io.loader import check_model_path, default_model_path
    if args.shape:
        model = Path(default_model_path())                    # its tokenizer goes into the checkpoint
    else:
        model = check_model_path(args.model)
        if model.is_dir():
            raise ValueError(f"--model {args.model}: fdx bench peers needs a .gguf file (llama.cpp reads GGUF only)")
    # SIGTERM unwinds like Ctrl-C, so the build and the servers started here are stopped
    # (set again after the sgemm probe: importing Paddle installs its own handler)
    prev = signal.signal(signal.SIGTERM, _interrupt)
    try:
        report = _run(args, sizes, model)
    except PeerError as e:
        print(f"fdx bench peers: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fdx bench peers: interrupted; servers stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, prev)
    with contextlib.suppress(OSError):
        (Path(report["log_dir"]) / "report.json").write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(report, args.plot)
        _say(f"plot saved to {args.plot}")
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0


def _files(args, bins: dict, model: Path, kinds: list[str]) -> dict[str, Path]:
    """Each type's GGUF: from the given file, or from the shape's converted F16/BF16 GGUF."""
    if not args.shape:
        return {k: make_quant(bins["llama-quantize"], model, k) for k in kinds}
    src16 = make_shape_gguf(args.shape, llama_cpp_src(), model, args.shape_seed, args.shape_dtype)
    return {k: make_shape_quant(bins["llama-quantize"], src16, k) for k in kinds}


def _alternate(i: int, sides: list) -> list:
    """The sides in turn order for round i: rotated, so each runs first as often as the others."""
    k = i % len(sides)
    return sides[k:] + sides[:k]


def _run(args, sizes: list[int], model: Path) -> dict:
    threads = args.threads or available_cores()
    kinds = quant_types(args.quant)
    ik_src = ik_source(args.ik_llama_src)
    needed = ("llama-quantize", "llama-bench", "llama-batched-bench") + (() if args.skip_serve else ("llama-server",))
    bins = build_llama_cpp(args.llama_sdist, jobs=args.jobs, targets=needed)
    ik_bins = build_ik_llama(ik_src, jobs=args.jobs) if ik_src else None
    files = _files(args, bins, model, kinds)
    log_dir = peer_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"logs of this run: {log_dir}")
    _say("measuring the machine (sgemm, memory read)")
    machine = machine_info(threads)
    signal.signal(signal.SIGTERM, _interrupt)    # Paddle, imported by the probe, replaced it
    _say(format_machine(machine))
    extra = [a for kv in args.fdx_set for a in ("--set", kv)]
    report = {"model": str(files[kinds[0]]), "source_model": str(model), "shape": args.shape,
              "source": source_note(model, args.shape, args.shape_seed, args.shape_dtype),
              "input_len": args.input_len, "output_len": args.output_len, "prefill_len": args.prefill_len,
              "repeats": args.repeats, "machine": machine, "types": [], "serve": None,
              "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "ik_llama_cpp": str(ik_src) if ik_src else None,
              "log_dir": str(log_dir)}
    for kind in kinds:
        path, fdx_extra = files[kind], [*fdx_quant_args(kind), *extra]
        entry = {"type": kind, "model": str(path), "file_mb": path.stat().st_size / 2 ** 20,
                 "fdx_args": fdx_quant_args(kind), "prefill": None, "batches": []}
        if args.prefill_len:
            n = args.prefill_len
            sides = [("llama.cpp", lambda: run_llama_bench(bins["llama-bench"], path, n, threads, args.repeats,
                                                           log_dir, f"{kind}-pp{n}", mmap=args.llama_mmap)),
                     ("fdx", lambda: best_run([run_fdx_throughput(path, 1, n, 1, threads, log_dir, fdx_extra,
                                                                  f"{kind}-pp{n}-{r + 1}")
                                               for r in range(args.repeats)], "prompt_tps"))]
            if ik_bins:
                sides.append(("ik_llama.cpp", lambda: run_llama_bench(ik_bins["llama-bench"], path, n, threads,
                                                                      args.repeats, log_dir, f"{kind}-pp{n}",
                                                                      ik=True)))
            got = {}
            for name, fn in _alternate(kinds.index(kind), sides):
                _say(f"{kind} prefill {n}: {name}")
                got[name] = fn()
                _say(f"{kind} prefill {n}: {name}: {got[name]['prompt_tps']:.1f} tok/s, "
                     f"peak {got[name]['peak_rss_mb']:.0f} MB")
            entry["prefill"] = prefill_row(n, got["llama.cpp"], got["fdx"], got.get("ik_llama.cpp"))
        for i, b in enumerate(sizes):
            got: dict[str, list[dict]] = {"llama.cpp": [], "fdx": [], "ik_llama.cpp": []}
            for rep in range(args.repeats):
                tag = f"{kind}-B{b}" + (f"-{rep + 1}" if args.repeats > 1 else "")
                sides = [("llama.cpp", lambda: run_llama_batched(bins["llama-batched-bench"], path, b, args.input_len,
                                                                 args.output_len, threads, log_dir, tag,
                                                                 mmap=args.llama_mmap)),
                         ("fdx", lambda: run_fdx_throughput(path, b, args.input_len, args.output_len, threads,
                                                            log_dir, fdx_extra, tag))]
                if ik_bins:
                    sides.append(("ik_llama.cpp", lambda: run_llama_batched(
                        ik_bins["llama-batched-bench"], path, b, args.input_len, args.output_len, threads, log_dir,
                        tag, ik=True)))
                for name, fn in _alternate(i + rep, sides):     # alternate which side runs first
                    _say(f"{kind} B={b}: {name}" + (f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
                    got[name].append(fn())
                    _say(f"{kind} B={b}: {name}: all {got[name][-1]['all_tps']:.1f} tok/s, "
                         f"peak {got[name][-1]['peak_rss_mb']:.0f} MB")
            entry["batches"].append(batch_row(b, best_run(got["llama.cpp"]), best_run(got["fdx"]),
                                              best_run(got["ik_llama.cpp"]) if ik_bins else None))
        report["types"].append(entry)
    report["batches"] = report["types"][0]["batches"]
    if not args.skip_serve:
        report["serve"] = _serve(args, bins, files[kinds[0]], threads, log_dir,
                                 [*fdx_quant_args(kinds[0]), *extra])
    return report


def _serve(args, bins: dict, f32: Path, threads: int, log_dir: Path, extra: list[str]) -> dict:
    n, c = args.serve_requests, args.serve_concurrency
    ctx = c * (args.input_len + args.output_len + 64)
    results = {}
    port = free_port()
    llama_cmd = [str(bins["llama-server"]), "-m", str(f32), "--host", "127.0.0.1", "--port", str(port),
                 "-np", str(c), "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
                 *(() if args.llama_mmap else READ_AT_LOAD)]
    _say(f"serving: llama-server -np {c} on port {port}")
    with ManagedServer("llama-server", llama_cmd, port, log_dir / "llama-server.log") as srv:
        srv.wait_ready(args.ready_timeout)
        results["llama"] = run_serve_bench(srv.base_url, n, c, args.input_len, args.output_len,
                                           log_dir / "bench-serve-llama.log")
    _say(f"serving: llama-server {results['llama']['output_tps']:.1f} output tok/s")
    port = free_port()
    fdx_cmd = _fdx_cmd("serve", "--model", str(f32), "--host", "127.0.0.1", "--port", str(port),
                       "--num-threads", str(threads), "--quiet", *extra)
    if c > 64:                                  # fdx's default max_num_seqs
        fdx_cmd += ["--max-num-seqs", str(c)]
    env = {k: v for k, v in os.environ.items() if k not in ("FDX_API_KEY",)}
    _say(f"serving: fdx serve on port {port}")
    with ManagedServer("fdx serve", fdx_cmd, port, log_dir / "fdx-serve.log", env=env) as srv:
        srv.wait_ready(args.ready_timeout)
        results["fdx"] = run_serve_bench(srv.base_url, n, c, args.input_len, args.output_len,
                                         log_dir / "bench-serve-fdx.log")
    _say(f"serving: fdx serve {results['fdx']['output_tps']:.1f} output tok/s")
    return {"num_requests": n, "concurrency": c, **serve_row(results["llama"], results["fdx"])}


if __name__ == "__main__":
    sys.exit(main(prog=f"python {Path(__file__).name}"))
