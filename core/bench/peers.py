"""``fdx bench peers``: fdx side by side with llama.cpp on this machine.

Both engines run on the same machine in one run, on identical fp32 weights:

1. llama.cpp is built once from the sources inside the PyPI sdist of
   llama-cpp-python (its vendor/llama.cpp; cmake with -DGGML_NATIVE=ON) and
   cached under $FDX_CACHE_DIR (else ~/.cache/fdx) in
   ``peers/llama.cpp-<version>-<cpu hash>``: native code is CPU-specific.
2. ``llama-quantize --allow-requantize <model> <out> F32`` turns the model
   (default: the embedded Q4_1 SmolLM2) into an F32 GGUF, cached; fdx loads
   that same file, so both compute on the same fp32 values.
3. The machine is measured: CPU model, cores, sgemm GFLOP/s (Paddle's
   matmul on all cores), single-thread memory read GB/s (numpy).
4. For each batch size B, ``llama-batched-bench -npp I -ntg O -npl B`` and
   ``fdx bench throughput --num-requests B --input-len I --output-len O``
   run alternately, each in its own process.
5. Serving: ``fdx bench serve --token-ids`` against ``llama-server -np C``
   and against ``fdx serve``, both on the F32 file, one after the other.

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

from fdx.core.host import available_cores, cache_root, cpu_id, cpu_model

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
TARGETS = ("llama-batched-bench", "llama-server", "llama-quantize", "llama-perplexity")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DBUILD_SHARED_LIBS=OFF")
DEFAULT_BATCH_SIZES = (1, 8, 32, 64)


class PeerError(Exception):
    """A failure the user can act on: printed as one line, no traceback."""


def _say(msg: str) -> None:
    print(f"[fdx bench peers] {msg}", file=sys.stderr, flush=True)


# --- where things are cached -----------------------------------------------------------

def peer_dir(root: Path | None = None) -> Path:
    h = hashlib.sha256(cpu_id().encode()).hexdigest()[:12]
    return (root or cache_root()) / "peers" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{h}"


# --- building the peer -----------------------------------------------------------------

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


def build_llama_cpp(sdist: str | None = None, root: Path | None = None, jobs: int | None = None,
                    progress: bool = True) -> dict[str, Path]:
    """Build llama-batched-bench, llama-server, llama-quantize and llama-perplexity once; their paths."""
    d = peer_dir(root)
    bins = {t: d / "build" / "bin" / t for t in TARGETS}
    stamp = d / "build.ok"
    if stamp.is_file() and all(p.is_file() for p in bins.values()):
        return bins
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if shutil.which("c++") is None and shutil.which("g++"):
        missing.remove("c++")
    if missing:
        raise PeerError(f"building llama.cpp needs {' and '.join(missing)} on PATH "
                        f"(for example: apt-get install cmake g++)")
    src = d / "src"
    if not (src / "CMakeLists.txt").is_file():
        extract_llama_cpp(obtain_sdist(sdist, (root or cache_root()) / "peers"), src)
    jobs = jobs or available_cores()
    log_path = d / "build.log"
    _say(f"building llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} with -j{jobs} "
         f"(once, minutes; log: {log_path})")
    t0 = time.perf_counter()
    with open(log_path, "a") as log:
        if not (d / "build" / "CMakeCache.txt").is_file():
            gen = ["-G", "Ninja"] if shutil.which("ninja") else []
            _run_logged(["cmake", "-S", str(src), "-B", str(d / "build"), *gen, *CMAKE_FLAGS], log,
                        "configuring llama.cpp (cmake)", progress)
        _run_logged(["cmake", "--build", str(d / "build"), f"-j{jobs}", "--target", *TARGETS], log,
                    "building llama.cpp", progress)
    absent = [t for t, p in bins.items() if not p.is_file()]
    if absent:
        raise PeerError(f"the llama.cpp build finished without {', '.join(absent)}; the log is {log_path}")
    stamp.write_text(f"{' '.join(TARGETS)} built by fdx bench peers\n")
    _say(f"llama.cpp built in {time.perf_counter() - t0:.0f} s")
    return bins


def make_f32(quantize: Path, model: Path, root: Path | None = None) -> Path:
    """The model as an F32 GGUF (llama-quantize --allow-requantize ... F32), made once."""
    out_dir = (root or cache_root()) / "peers" / "models"
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
    from fdx.core.checkpoint.gguf_file import read_gguf
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


def machine_info(threads: int, quick: bool = False) -> dict:
    """What the report is headed by. quick: smaller probes (for tests)."""
    return {
        "cpu": cpu_model(), "cores": available_cores(), "threads": threads,
        "sgemm_gflops": sgemm_gflops((256, 512) if quick else (1024, 2048), threads=threads),
        "memory_read_gbps": memory_read_gbps(64 if quick else 512),
        "mkl_debug_cpu_type": os.environ.get("MKL_DEBUG_CPU_TYPE"),   # fdx sets 7 at import: MKL's AVX2 path
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def format_machine(m: dict) -> str:
    load = f", load average {m['load_avg_1m']:.1f} at the start" if m.get("load_avg_1m") is not None else ""
    return (f"{m['cpu']}, {m['cores']} cores ({m['threads']} threads used), sgemm {m['sgemm_gflops']:.0f} GFLOP/s, "
            f"memory read {m['memory_read_gbps']:.1f} GB/s (1 thread){load}")


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


def run_llama_batched(binary: Path, model: Path, batch: int, input_len: int, output_len: int, threads: int,
                      log_dir: Path, tag: str = "") -> dict:
    ctx = max(batch * (input_len + output_len), 256)      # its warm-up decodes 16 tokens in one batch
    cmd = [str(binary), "-m", str(model), "-npp", str(input_len), "-ntg", str(output_len), "-npl", str(batch),
           "-t", str(threads), "-tb", str(threads), "-c", str(ctx)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (log_dir / f"llama-batched-bench-{tag or f'B{batch}'}.log").write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    if r.returncode != 0:
        raise PeerError(f"llama-batched-bench (B={batch}) failed with exit code {r.returncode}: {_tail(r.stderr)}")
    return llama_figures(parse_batched_bench(r.stdout + "\n" + r.stderr)[-1])


def llama_figures(row: dict) -> dict:
    """A llama-batched-bench row as the report's figures: prompt = S_PP, decode = S_TG, all = S."""
    return {"prompt_tps": row["s_pp"], "decode_tps": row["s_tg"], "all_tps": row["s"], "total_s": row["t"],
            "raw": row}


def _fdx_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fdx.core.cli", *args]


def _json_out(stdout: str) -> dict:
    start = stdout.find("{")
    if start < 0:
        raise ValueError("no JSON in the output")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]      # whatever follows the object is ignored


def run_fdx_throughput(model: Path, batch: int, input_len: int, output_len: int, threads: int,
                       log_dir: Path, extra: list[str], tag: str = "") -> dict:
    cmd = _fdx_cmd("bench", "throughput", "--model", str(model), "--num-requests", str(batch),
                   "--input-len", str(input_len), "--output-len", str(output_len), "--json", "--quiet",
                   "--num-threads", str(threads), *extra)
    if batch > 64:                              # fdx's default max_num_seqs
        cmd += ["--max-num-seqs", str(batch)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (log_dir / f"fdx-throughput-{tag or f'B{batch}'}.log").write_text(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    if r.returncode != 0:
        raise PeerError(f"fdx bench throughput (B={batch}) failed with exit code {r.returncode}: {_tail(r.stderr)}")
    try:
        d = _json_out(r.stdout)
    except ValueError as e:
        raise PeerError(f"fdx bench throughput (B={batch}) printed no JSON ({e})") from None
    return fdx_figures(d)


def fdx_figures(d: dict) -> dict:
    """fdx bench throughput's JSON as the report's figures: prompt = tokens of the steps
    with prefill / their time, decode = tokens of decode-only steps / their time,
    all = (prompt + output tokens) / wall time, as llama-batched-bench's S."""
    return {"prompt_tps": d["prompt_tokens_per_s"], "decode_tps": d["decode_tokens_per_s"],
            "all_tps": d["overall_tokens_per_s"], "total_s": d["total_time_s"], "raw": d}


def best_run(runs: list[dict]) -> dict:
    """Of repeated runs of one side, the one with the best all tok/s (the least
    disturbed on a shared machine), with every run's all tok/s beside it."""
    best = dict(max(runs, key=lambda r: r["all_tps"]))
    best["all_tps_runs"] = [r["all_tps"] for r in runs]
    return best


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def batch_row(batch: int, llama: dict, fdx: dict) -> dict:
    """One table row: both sides' prompt, decode and all tok/s and fdx/llama.cpp ratios."""
    keys = ("prompt_tps", "decode_tps", "all_tps", "total_s", "all_tps_runs")
    row = {"batch": batch, "llama": {k: llama[k] for k in keys if k in llama},
           "fdx": {k: fdx[k] for k in keys if k in fdx}}
    row["ratio"] = {k: _ratio(fdx[k], llama[k]) for k in ("prompt_tps", "decode_tps", "all_tps")}
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


def format_table(report: dict) -> str:
    types = report.get("types") or [{"type": "F32", "model": report["model"], "batches": report["batches"]}]
    lines = [f"fdx bench peers: fdx beside llama.cpp (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}'s vendor copy), "
             f"{report['input_len']} prompt + {report['output_len']} output tokens per sequence",
             f"machine: {format_machine(report['machine'])}"]
    for t in types:
        lines += ["", f"{t['type']}: {t['model']} (fdx {' '.join(t.get('fdx_args') or fdx_quant_args(t['type']))})"]
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


def _batch_table(batches: list[dict]) -> list[str]:
    lines = ["| B | llama prompt | fdx prompt | ratio | llama decode | fdx decode | ratio "
             "| llama all | fdx all | ratio |", "|" + "---|" * 10]
    for row in batches:
        ll, fx, ra = row["llama"], row["fdx"], row["ratio"]
        lines.append(f"| {row['batch']} | {_f(ll['prompt_tps'])} | {_f(fx['prompt_tps'])} | {_r(ra['prompt_tps'])} "
                     f"| {_f(ll['decode_tps'])} | {_f(fx['decode_tps'])} | {_r(ra['decode_tps'])} "
                     f"| {_f(ll['all_tps'])} | {_f(fx['all_tps'])} | {_r(ra['all_tps'])} |")
    lines.append("(tok/s; ratio = fdx / llama.cpp; prompt = S_PP vs prefill steps, decode = S_TG vs decode-only "
                 "steps, all = (prompt + output) / wall: S vs overall_tokens_per_s)")
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

def add_parser(bsub) -> argparse.ArgumentParser:
    s = bsub.add_parser("peers", help="fdx side by side with llama.cpp on this machine (builds llama.cpp once)",
                        description="Builds llama.cpp once (cached) from the llama-cpp-python sdist, makes an F32 "
                                    "GGUF of the model with llama-quantize, measures the machine, then runs "
                                    "llama-batched-bench against fdx bench throughput for each batch size and "
                                    "llama-server against fdx serve with fdx bench serve. Takes minutes. "
                                    "See docs/benchmarks.md.")
    s.add_argument("--model", "-m", default=None,
                   help="a .gguf file, turned into F32 for both engines (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="comma-separated sequences per batch (default: %(default)s)")
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens per sequence (default: %(default)s)")
    s.add_argument("--output-len", type=int, default=128, help="generated tokens per sequence (default: %(default)s)")
    s.add_argument("--quant", default="F32",
                   help="comma-separated GGUF types to compare on, each file made with llama-quantize from the "
                        f"F32 one ({', '.join(QUANT_TYPES)}); fdx runs each with --quantization auto, F32 with "
                        "none (default: %(default)s)")
    s.add_argument("--threads", type=int, default=None, help="threads for both engines (default: the cores)")
    s.add_argument("--repeats", type=int, default=1,
                   help="runs of each side per batch size, alternating; the best all tok/s of each side is "
                        "reported (default: %(default)s)")
    s.add_argument("--skip-serve", action="store_true", help="no serving comparison (default: run it)")
    s.add_argument("--serve-requests", type=int, default=64, help="streaming requests per server (default: %(default)s)")
    s.add_argument("--serve-concurrency", type=int, default=32,
                   help="requests in flight, and llama-server's -np (default: %(default)s)")
    s.add_argument("--llama-sdist", default=None,
                   help=f"path of {SDIST_NAME} (default: the cached copy, else pip download)")
    s.add_argument("--jobs", type=int, default=None, help="parallel compile jobs for the build (default: the cores)")
    s.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for each server to be ready (default: %(default)s)")
    s.add_argument("--fdx-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config key for fdx's runs (bench throughput and serve) as --set KEY=VALUE; "
                        "repeatable (default: none)")
    s.add_argument("--json", action="store_true", help="print the report as JSON (default: a table)")
    s.add_argument("--plot", default=None, metavar="OUT.png",
                   help="save all tok/s against batch size, fdx beside llama.cpp; needs matplotlib (default: none)")
    s.set_defaults(func=cmd_bench_peers)
    return s


def _batch_sizes(text: str) -> list[int]:
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
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("fdx bench peers: --plot needs matplotlib: pip install matplotlib") from None
    from fdx.core.checkpoint.loader import check_model_path
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


def _run(args, sizes: list[int], model: Path) -> dict:
    threads = args.threads or available_cores()
    kinds = quant_types(args.quant)
    bins = build_llama_cpp(args.llama_sdist, jobs=args.jobs)
    files = {k: make_quant(bins["llama-quantize"], model, k) for k in kinds}
    log_dir = peer_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S")
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"logs of this run: {log_dir}")
    _say("measuring the machine (sgemm, memory read)")
    machine = machine_info(threads)
    signal.signal(signal.SIGTERM, _interrupt)    # Paddle, imported by the probe, replaced it
    _say(format_machine(machine))
    extra = [a for kv in args.fdx_set for a in ("--set", kv)]
    report = {"model": str(files[kinds[0]]), "source_model": str(model), "input_len": args.input_len,
              "output_len": args.output_len, "repeats": args.repeats, "machine": machine, "types": [],
              "serve": None,
              "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "log_dir": str(log_dir)}
    for kind in kinds:
        path, fdx_extra = files[kind], [*fdx_quant_args(kind), *extra]
        batches = []
        for i, b in enumerate(sizes):
            got: dict[str, list[dict]] = {"llama.cpp": [], "fdx": []}
            for rep in range(args.repeats):
                tag = f"{kind}-B{b}" + (f"-{rep + 1}" if args.repeats > 1 else "")
                sides = [("llama.cpp", lambda: run_llama_batched(bins["llama-batched-bench"], path, b, args.input_len,
                                                                 args.output_len, threads, log_dir, tag)),
                         ("fdx", lambda: run_fdx_throughput(path, b, args.input_len, args.output_len, threads,
                                                            log_dir, fdx_extra, tag))]
                if (i + rep) % 2:
                    sides.reverse()              # alternate which side runs first
                for name, fn in sides:
                    _say(f"{kind} B={b}: {name}" + (f" (run {rep + 1} of {args.repeats})" if args.repeats > 1 else ""))
                    got[name].append(fn())
                    _say(f"{kind} B={b}: {name}: all {got[name][-1]['all_tps']:.1f} tok/s")
            batches.append(batch_row(b, best_run(got["llama.cpp"]), best_run(got["fdx"])))
        report["types"].append({"type": kind, "model": str(path), "fdx_args": fdx_quant_args(kind),
                                "batches": batches})
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
                 "-np", str(c), "-c", str(ctx), "-t", str(threads), "-tb", str(threads)]
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
