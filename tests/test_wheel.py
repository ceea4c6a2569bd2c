"""A built wheel (not the editable checkout) installed into a virtualenv
that sees this interpreter's packages for fdx's dependencies and where
`import torch` fails, serving from a fresh kernel cache: the package data
ships (the page's files, ops/csrc/), serving needs no torch, and the
compiled kernel is built before /health says ready, never after."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time
import zipfile

import httpx
import pytest
import yaml
from conftest import local_build_flags, make_venv
from serve_utils import API_KEY, free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Makes `import torch` (and anything under it) fail in the wheel's virtualenv,
# which otherwise sees this interpreter's packages for fdx's dependencies.
BLOCK_TORCH = '''
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this virtualenv: fdx serve must not need it")
        return None
sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> pathlib.Path:
    import shutil
    out = tmp_path_factory.mktemp("wheel")
    src = out / "src"                       # a copy: building in place would leave build/ in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", "tests"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *local_build_flags(), "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=600)
    (wheel,) = out.glob("fdx-*.whl")
    return wheel


def test_wheel_holds_the_package_data(built_wheel):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    for f in ("fdx/entrypoints/serving/static/index.html", "fdx/entrypoints/serving/static/app.js",
              "fdx/entrypoints/serving/static/style.css", "fdx/ops/csrc/fdx_ops.cc",
              "fdx/ops/csrc/paged_attention_kernel.h", "fdx/ops/csrc/fused_kernels.h", "fdx/entrypoints/serving/ui.py"):
        assert f in names, f
    assert not any(n.startswith("fdx/tests/") for n in names)


class WheelServer:
    """`fdx serve` from the wheel's console script, with its /health answers
    recorded from the moment the process starts."""

    def __init__(self, tmp: pathlib.Path, wheel: pathlib.Path):
        venv = tmp / "venv"
        py = make_venv(venv)                     # fdx's dependencies: this interpreter's
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        pathlib.Path(site, "sitecustomize.py").write_text(BLOCK_TORCH)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True,
                       capture_output=True, timeout=600)
        self.env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        self.cache = tmp / "fresh-cache"
        self.env.update(FDX_CACHE_DIR=str(self.cache), PYTHONUNBUFFERED="1", FDX_LOG_LEVEL="info")
        where = subprocess.run([str(py), "-c", "import fdx, sys; print(fdx.__file__); import torch"],
                               capture_output=True, text=True, cwd=tmp, env=self.env)
        self.fdx_file, self.torch_error = where.stdout.strip(), where.stderr
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "fdx.yaml"
        cfg.write_text(yaml.safe_dump({"model": {"max_model_len": 512}, "cache": {"num_kv_blocks": 64},
                                       "server": {"api_key": API_KEY, "log_level": "warning"}}))
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        self.started = time.time()
        self.proc = subprocess.Popen([str(venv / "bin" / "fdx"), "serve", "--config", str(cfg), "--port",
                                      str(self.port)], stdout=self._log, stderr=subprocess.STDOUT, cwd=tmp,
                                     env=self.env)
        self.health: list[tuple[float, int, str]] = []     # (time, status, error message)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 600) -> float:
        deadline = time.monotonic() + timeout
        # one client for every poll: httpx.get builds an SSL context each call (about 25 ms of CPU),
        # which over a cold build's minutes of polling cost the test process 20 s of CPU
        with httpx.Client(timeout=2) as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"fdx serve exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
                try:
                    r = http.get(self.base_url + "/health")
                    body = r.json()
                    self.health.append((time.time(), r.status_code, (body.get("error") or {}).get("message", "")))
                    if r.status_code == 200:
                        return time.time()
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise RuntimeError(f"fdx serve did not become ready in {timeout} s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def wheel_server(built_wheel, tmp_path_factory):
    srv = WheelServer(tmp_path_factory.mktemp("wheel_serve"), built_wheel)
    try:
        srv.ready_at = srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def _cache_files(cache: pathlib.Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in cache.rglob("*") if p.is_file()}


def test_kernel_is_built_before_ready_and_never_after(wheel_server):
    srv = wheel_server
    assert srv.fdx_file.startswith(str(srv.cache.parent / "venv")), srv.fdx_file   # the wheel, not the checkout
    assert "torch is blocked" in srv.torch_error
    # while it loaded and built, /health said 503 "loading"
    assert srv.health[-1][1] == 200
    assert any(status == 503 and msg == "loading" for _, status, msg in srv.health[:-1]), srv.health[:5]
    (built,) = list(srv.cache.glob("ops/*/.built"))
    assert built.stat().st_mtime <= srv.ready_at
    log = srv.log()
    lines = log.splitlines()
    (build_line,) = [i for i, line in enumerate(lines) if "built the compiled CPU kernels" in line]
    # fdx's one log format (fdx.core.logs): the time, the level, the logger
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO fdx\.ops\.cpp: built the compiled CPU kernels "
                        r"\(ops/csrc/.* in \d+\.\d s, cached in .*", lines[build_line]), lines[build_line]
    (ready_line,) = [i for i, line in enumerate(lines) if line.startswith("fdx serve: SmolLM2-135M-Instruct at ")]
    assert build_line < ready_line
    for noise in ("g++", "ccache", "Compiling user custom op", "OMP_NUM_THREADS", "Traceback"):
        assert noise not in log, noise
    assert "Compiling user custom op" in (built.parent / "build.log").read_text()   # Paddle's build output went here
    before = _cache_files(srv.cache)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for n in (4, 6):
        r = httpx.post(srv.base_url + "/v1/completions", headers=headers, timeout=300,
                       json={"prompt": "The sea is", "max_tokens": n, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
    assert _cache_files(srv.cache) == before                            # nothing built on a request
    assert "built the compiled CPU kernels" not in "\n".join(srv.log().splitlines()[ready_line:])
    stats = httpx.get(srv.base_url + "/v1/engine/stats", headers=headers, timeout=30).json()
    assert stats["kernels"].startswith("built the compiled CPU kernels")


def test_wheel_serves_a_chat_completion_and_its_page_without_torch(wheel_server):
    import openai
    client = openai.OpenAI(base_url=wheel_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    # the README's example, whose greedy answer holds on every CPU (tokens ahead by 0.85 or more)
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of Japan?"}])
    assert r.choices[0].message.content == "The capital of Japan is Tokyo.", r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    page = httpx.get(wheel_server.base_url + "/", timeout=30)
    assert page.status_code == 200 and "/ui/app.js" in page.text
    assert httpx.get(wheel_server.base_url + "/ui/app.js", timeout=30).status_code == 200
