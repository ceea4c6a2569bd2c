"""Start a real ``fdx serve`` subprocess on a free loopback port, for tests."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import yaml

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_all(procs) -> None:
    """Stop servers and routers together: SIGTERM to each first, then wait
    for each (a graceful shutdown is mostly waiting, so several in turn
    cost their sum of wall time; together, about the longest one)."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGTERM)
    for p in procs:
        p.stop()


class ServerProcess:
    def __init__(self, tmp: pathlib.Path, server: dict | None = None, preexec_fn=None, **sections):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = {"model": {"max_model_len": 512}, "cache": {"block_size": 16, "num_kv_blocks": 64},
                  "server": {"api_key": API_KEY, "log_level": "warning", **(server or {})}}
        for k, v in sections.items():
            config.setdefault(k, {}).update(v)
        cfg = tmp / "fdx.yaml"
        cfg.write_text(yaml.safe_dump(config))
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fdx.entrypoints.cli", "serve", "--config", str(cfg), "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=preexec_fn)

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as http:    # one client: httpx.get builds an SSL context a call (25 ms of CPU)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fdx serve exited with {self.proc.returncode}:\n{self.log()}")
                try:
                    if http.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)                  # a tenth of a second of a test's wait, not half
        raise RuntimeError(f"fdx serve did not become healthy in {timeout} s:\n{self.log()}")

    def engine_pid(self) -> int:
        children = pathlib.Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            cmd = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"fdx.entrypoints.serving.engine_proc" in cmd:
                return int(pid)
        raise RuntimeError("no engine process found")

    def engine_args(self, pid: int | None = None) -> list[str]:
        """The command line of the engine process (or of process ``pid``)."""
        cmd = pathlib.Path(f"/proc/{pid or self.engine_pid()}/cmdline").read_bytes().split(b"\0")
        return [a.decode() for a in cmd]

    def engine_sockets(self) -> tuple[str, str]:
        """The engine's ipc:// addresses (inbox, outbox)."""
        args = self.engine_args()
        return args[args.index("--inbox") + 1], args[args.index("--outbox") + 1]

    def socket_dir(self) -> pathlib.Path:
        """The private folder (/tmp/fdx-*) that holds the engine's sockets."""
        return pathlib.Path(self.engine_sockets()[0][len("ipc://"):]).parent

    def tp_dirs(self) -> list[pathlib.Path]:
        """The sockets' folders (/tmp/fdx-tp-*) of the engine's tensor parallel workers."""
        engine = self.engine_pid()
        dirs = set()
        for pid in pathlib.Path(f"/proc/{engine}/task/{engine}/children").read_text().split():
            args = self.engine_args(int(pid))
            if "fdx.plugins.backends.tp" in args:
                dirs.add(pathlib.Path(args[args.index("--dir") + 1]))
        return sorted(dirs)

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics as {name{labels}: value}, plus {name: value} for single-series names."""
        out: dict[str, float] = {}
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            out.setdefault(key.split("{", 1)[0], float(value))
        return out

    def stop(self) -> None:
        terminate(self.proc, 30)
        self._log.close()


class RouterProcess:
    """A real ``fdx router`` subprocess on a free loopback port."""

    def __init__(self, tmp, prefill: list[str], decode: list[str], *extra: str, preexec_fn=None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"router-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fdx.entrypoints.cli", "router", "--port", str(self.port), "--health-interval", "0.5",
             "--log-level", "info", *extra, "--prefill", *prefill, "--decode", *decode],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=preexec_fn)

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.log_path.read_text()
                try:
                    if http.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        raise RuntimeError(self.log_path.read_text())

    def status(self) -> dict:
        return httpx.get(self.base_url + "/status", timeout=5).json()

    def stop(self) -> None:
        terminate(self.proc, 15)
        self._log.close()


def ready_server(tmp: pathlib.Path, server: dict | None = None, preexec_fn=None, **sections) -> ServerProcess:
    """A ``ServerProcess`` that answers /health (stopped again if it never does)."""
    srv = ServerProcess(tmp, server, preexec_fn, **sections)
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_for(cond, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond()`` until it is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class StreamWatch:
    """One long stream (4000 tokens) read in a thread, each chunk's arrival
    stamped in ``stamps``; a context manager (the thread stops on leaving)."""

    def __init__(self, base_url: str):
        self.base_url, self.stamps, self._stop = base_url, [], threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json={"prompt": [100, 200, 300], "max_tokens": 4000,
                                                               "ignore_eos": True, "stream": True}) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.stamps.append(time.monotonic())
                    if self._stop.is_set():
                        return

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        """Until ``n`` chunks have come (polled; a minute means a hang)."""
        deadline = time.monotonic() + timeout
        while len(self.stamps) < n and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.02)
        assert len(self.stamps) >= n, f"the stream stopped at {len(self.stamps)} chunks (waited for {n})"

    def __enter__(self) -> "StreamWatch":
        self._thread.start()
        self.wait_for(20)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)


def max_gap(stamps: list[float], t0: float, t1: float) -> float:
    """The longest gap between stamps within [t0, t1] (inf with fewer than two)."""
    inside = [t for t in stamps if t0 <= t <= t1]
    return max((b - a for a, b in zip(inside, inside[1:])), default=float("inf"))


@contextlib.contextmanager
def serving(tmp: pathlib.Path, server: dict | None = None, **sections):
    """A ready ``fdx serve`` (``ready_server``'s arguments), stopped on leaving."""
    srv = ready_server(tmp, server, **sections)
    try:
        yield srv
    finally:
        srv.stop()


def openai_client(srv: ServerProcess, **kw):
    """The openai SDK's client for ``srv`` (no retries: a failure shows)."""
    import openai
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300, **kw)
