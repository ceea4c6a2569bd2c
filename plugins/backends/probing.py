"""The CPU backend's kernel probe: in a child process, cached per host.

``probe_table(names, threads)`` returns a ``KernelTable`` for the kernels
``names`` (fdx.ops.probes): from the cache when this host has probed them
before, else by running ``python -m fdx.plugins.backends.probe_child`` (fdx.ops.probes'
child protocol, plus the decoder-layer probe) in a child. A child
killed by a signal is a finding for the kernel it was running (``SIGILL on
this CPU``), and a new child probes the rest; a child that hangs is
killed after PROBE_TIMEOUT_S. The cache file is keyed by everything that
decides what a kernel does here: the CPU model and flags, the Paddle build,
the fdx version, the compiled kernels' build and the probes' own source,
the portable setting and MKL's CPU type. A file written on other CPU
flags (a copied cache folder) is never read. One process probes at a time
(a file lock): tensor-parallel ranks and parallel test runners wait for
the first and then read its findings.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import fdx
from fdx.core.host import PORTABLE_ENV, cache_root, cpu_id, portable_kernels, signal_name
from fdx.core.kernels import KernelTable

log = logging.getLogger("fdx.backends.probing")

PROBE_TIMEOUT_S = float(os.environ.get("FDX_PROBE_TIMEOUT_S", "180"))   # per child; Paddle's import is most of it


def _key_material(names: list[str], extra: str) -> dict[str, str]:
    from fdx.ops import cpp, probes
    return {
        "cpu": cpu_id(),
        "paddle": cpp.paddle_build(),
        "fdx": fdx.__version__,
        "probes": hashlib.sha256(Path(probes.__file__).read_bytes()).hexdigest()[:16],
        "compiled": extra,
        "kernels": ",".join(sorted(names)),
        "portable": str(portable_kernels()),
        "mkl_cpu_type": os.environ.get("MKL_DEBUG_CPU_TYPE", ""),
    }


def cache_path(material: dict[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"{digest}.json"


def _read(path: Path, material: dict[str, str]) -> dict[str, str | None] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != material or not isinstance(data.get("findings"), dict):
        return None                        # another host's or another build's file under this name
    return data["findings"]


def _finding(status: int) -> str:
    if status < 0:
        name = signal_name(status)
        return f"{name} on this CPU" if -status == signal.SIGILL else f"killed by {name}"
    return f"the probe process exited with status {status}"


def _child(names: list[str], threads: int, log_file) -> dict[str, str | None]:
    """Run probes in one child: what it reported, plus a finding for the
    kernel that killed it or that was still running at the deadline."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "fdx.plugins.backends.probe_child", "--threads", str(threads), *names]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL, env=env,
                            text=True)
    fired = threading.Event()
    timer = threading.Timer(PROBE_TIMEOUT_S, lambda: (fired.set(), proc.kill()))
    timer.start()
    found: dict[str, str | None] = {}
    running: str | None = None
    try:
        for line in proc.stdout:
            kind, _, rest = line.strip().partition(" ")
            if kind == "start":
                running = rest
            elif kind == "done":
                name, _, finding = rest.partition(" ")
                found[name] = json.loads(finding)
                running = None
        status = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    blame = running or next((n for n in names if n not in found), None)
    if blame is not None and (status or running):
        found[blame] = f"the probe timed out after {PROBE_TIMEOUT_S:.0f} s" if fired.is_set() else _finding(status)
    return found


def _probe(names: list[str], threads: int, log_path: Path) -> dict[str, str | None]:
    """Every name's finding: a new child for what a dead one left."""
    found: dict[str, str | None] = {}
    with open(log_path, "a") as log_file:
        while rest := [n for n in names if n not in found]:
            got = _child(rest, threads, log_file)
            if not any(n in got for n in rest):          # nothing of these reported and no death: do not loop
                got = {n: "the probe process reported nothing" for n in rest}
            found.update(got)
    return found


def probe_table(names: list[str], threads: int, unavailable: dict[str, str] | None = None,
                compiled_key: str = "") -> KernelTable:
    """The table for ``names`` on this host (see the module docstring).
    ``unavailable``: kernels known not to run without probing (e.g. the
    compiled ones when the build failed), name -> why."""
    unavailable = dict(unavailable or {})
    if portable_kernels():
        unavailable.update({n: f"off ({PORTABLE_ENV})" for n in names
                            if not n.startswith("cpp.") and n not in unavailable})
    wanted = [n for n in names if n not in unavailable]
    material = _key_material(wanted, compiled_key)
    path = cache_path(material)
    t0 = time.perf_counter()
    findings = _read(path, material)
    source = "cache"
    if findings is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            findings = _read(path, material)           # another process probed while we waited
            if findings is None:
                source = "probed"
                log.info("probing the kernels on this CPU in a child process (once per host and build)")
                findings = _probe(wanted, threads, path.with_suffix(".log")) if wanted else {}
                tmp = Path(tempfile.mkstemp(dir=path.parent, suffix=".tmp")[1])
                tmp.write_text(json.dumps({"key": material, "findings": findings}, indent=1, sort_keys=True))
                tmp.replace(path)
    findings = {**findings, **unavailable}
    return KernelTable(findings={n: findings.get(n, "not probed") for n in names}, source=source,
                       seconds=time.perf_counter() - t0, location=str(path))
