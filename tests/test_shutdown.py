"""The API process never loads Paddle, and a stop is clean.

Paddle's import installs its own SIGTERM handler (a fatal-error dump), which
replaces uvicorn's: a server that had imported it died with status 143 and
left its socket folder behind. Here: the API side of ``fdx serve``, driven
through its routes with guided constraints of every kind and both backends
(which it only passes on: they compile in the engine), imports no Paddle; real servers stopped by SIGTERM or Ctrl-C exit 0 and
remove their /tmp/fdx-* folder (also when the engine or the API process is
killed); ``fdx router`` exits 0 too.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from serve_utils import API_KEY, ServerProcess, free_port, pid_alive, ready_server, wait_for

GRAMMAR = 'root ::= "(" [0-9]+ ")"'

# the API process's side of a server, in a fresh interpreter: each guided
# request goes through the real routes (pydantic, rendering); the engine,
# where constraints compile, is not started, so each gets 503 ("not
# accepting"), bad ones too (their 400s: tests/test_guided_server.py)
API_SIDE = r"""
import json, sys
from fastapi.testclient import TestClient
from fdx.model_io.loader import load_tokenizer
from fdx.core.config import FdxConfig
from fdx.entrypoints.serving.app import Server, build_app
from fdx.entrypoints.serving.rendering import Renderer

cases = json.loads(sys.argv[1])
tokenizer = load_tokenizer(None)
out = {}
for backend in ("xgrammar", "llguidance"):
    server = Server(FdxConfig.build(guided_backend=backend, request_scheduler="global"))
    server.tokenizer, server.max_model_len, server.vocab_size = tokenizer, 512, 49152
    server.render = Renderer(tokenizer, server.model_name, 512)
    client = TestClient(build_app(server))
    for name, (path, body) in cases.items():
        r = client.post(path, json=body)
        out[f"{backend} {name}"] = [r.status_code, r.json()["error"].get("param")]
    for path in ("/metrics", "/v1/engine/stats", "/health", "/v1/models"):
        client.get(path)
out["paddle"] = sorted(m for m in sys.modules if m.split(".")[0] == "paddle")
print(json.dumps(out))
"""


def chat_body(**kw) -> tuple[str, dict]:
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw}


def completion_body(**kw) -> tuple[str, dict]:
    return "/v1/completions", {"prompt": "x", "max_tokens": 8, **kw}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
GOOD = {
    "json_schema": chat_body(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    "json_object": chat_body(response_format={"type": "json_object"}, stream=True),
    "regex": completion_body(guided_regex="[0-9]{2}"),
    "choice": completion_body(guided_choice=["left", "right"]),
    "grammar": completion_body(guided_grammar=GRAMMAR),
}
BAD = {
    "bad json_schema": chat_body(response_format={"type": "json_schema",
                                                  "json_schema": {"name": "a", "schema": {"type": "nope"}}}),
    "bad regex": completion_body(guided_regex="(unclosed", stream=True),
    "bad grammar": completion_body(guided_grammar="root ::= (("),
}


@pytest.mark.slow
def test_api_side_never_imports_paddle():
    r = subprocess.run([sys.executable, "-c", API_SIDE, json.dumps({**GOOD, **BAD})], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for backend in ("xgrammar", "llguidance"):
        for name in {**GOOD, **BAD}:
            assert out[f"{backend} {name}"][0] == 503, (backend, name, out)     # on to admission: no engine
    assert out["paddle"] == []


def test_serving_plugins_register_every_builtin_the_api_looks_up():
    """The API process loads only SERVING_PLUGINS: they must hold every
    built-in request scheduler and chat output parser (guided backends run
    in the engine only)."""
    from fdx.core.plugins import SERVING_PLUGINS, PluginManager
    full = PluginManager(load_entry_points=False)
    serving = PluginManager(builtins=SERVING_PLUGINS, load_entry_points=False)
    for kind in ("scheduler", "tool_parser", "reasoning_parser"):
        assert serving.builtin_names(kind) == full.builtin_names(kind) != []


# -- real servers ---------------------------------------------------------------------

def maps_of(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/maps").read_text()


def start(tmp: pathlib.Path, model: pathlib.Path, backend: str, **sections) -> ServerProcess:
    tmp.mkdir(exist_ok=True)
    return ready_server(tmp, model={"model": str(model), "max_model_len": 256}, decoding={"guided_backend": backend},
                        **sections)


def guided_requests(srv: ServerProcess, api_key: str | None, served_guided: bool = True) -> None:
    """One constrained request that is served, one refused with 400."""
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=api_key or "unused", max_retries=0)
    choice = {"guided_choice": ["yes", "no"]} if served_guided else {}
    r = client.completions.create(model=None, prompt="x", max_tokens=8, extra_body=choice)
    assert r.choices[0].text in ("yes", "no") or not served_guided
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "response_format"


# Each setting once, not one server a setting (pairwise: the engine gets the same stop whichever
# signal the API process had; both rows have Paddle in the engine, which the assert below checks);
# llguidance serves a constrained request at TP 1 in test_killed_engine_or_api_process_...
@pytest.mark.parametrize("backend, sig, sections", [
    ("xgrammar", signal.SIGINT, {"server": {"api_key": None}}),
    ("llguidance", signal.SIGTERM, {"parallel": {"tensor_parallel_size": 2}}),        # with an API key
], ids=["xgrammar-nokey-sigint", "llguidance-key-tp2-sigterm"])
def test_serve_stops_with_status_0_and_removes_its_sockets(tmp_path, tiny_checkpoints, backend, sig, sections):
    path, _ = tiny_checkpoints["Qwen2ForCausalLM"]
    srv = start(tmp_path, path, backend, **sections)
    try:
        engine = srv.engine_pid()
        folders = [srv.socket_dir(), *srv.tp_dirs()]
        assert all(f.is_dir() and f.name.startswith("fdx-") for f in folders), folders
        assert len(folders) == (2 if "parallel" in sections else 1)       # the workers share one
        # the tensor parallel workers do not run the guided processor's matchers yet: an
        # unconstrained request is served there (the 400 is the API process's)
        guided_requests(srv, (sections.get("server") or {"api_key": API_KEY})["api_key"],
                        served_guided="parallel" not in sections)
        assert "libpaddle" in maps_of(engine)                # the check can see Paddle ...
        assert "libpaddle" not in maps_of(srv.proc.pid)      # ... and the API process has none
        srv.proc.send_signal(sig)
        assert srv.proc.wait(30) == 0, srv.log()
        assert [f for f in folders if f.exists()] == []
        assert not pid_alive(engine)
        assert "FatalError" not in srv.log() and "Traceback" not in srv.log(), srv.log()
    finally:
        srv.stop()


def test_killed_engine_or_api_process_leaves_no_socket_folder(tmp_path, tiny_checkpoints):
    """The engine killed: the server exits 1 and removes the folder. The API
    process killed outright: its engine, orphaned, removes it."""
    path, _ = tiny_checkpoints["Qwen2ForCausalLM"]
    srv = start(tmp_path / "a", path, "llguidance", server={"engine_death_grace_s": 0.5})
    try:
        folder = srv.socket_dir()
        os.kill(srv.engine_pid(), signal.SIGKILL)
        assert srv.proc.wait(30) == 1
        assert not folder.exists()
    finally:
        srv.stop()
    srv = start(tmp_path / "b", path, "llguidance")
    try:
        folder, engine = srv.socket_dir(), srv.engine_pid()
        guided_requests(srv, API_KEY)
        srv.proc.kill()
        srv.proc.wait(30)
        wait_for(lambda: not pid_alive(engine), what="the orphaned engine to exit")
        wait_for(lambda: not folder.exists(), timeout=5, what="the orphaned engine to remove the socket folder")
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_router_stops_with_status_0(tmp_path, sig):
    """``fdx router`` (no engine, no socket folder) also exits 0, and loads no Paddle."""
    port = free_port()
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "fdx.entrypoints.cli", "router", "--port", str(port),
                             "--prefill", f"http://127.0.0.1:{free_port()}",
                             "--decode", f"http://127.0.0.1:{free_port()}"], stdout=log, stderr=subprocess.STDOUT)

    http = httpx.Client(timeout=2)             # one client for the polls (httpx.get builds an SSL context a call)

    def listening() -> bool:
        assert proc.poll() is None, (tmp_path / "router.log").read_text()
        try:                                   # up, with no instance in rotation
            return http.get(f"http://127.0.0.1:{port}/health").status_code == 503
        except httpx.HTTPError:
            return False
    try:
        with http:
            wait_for(listening, 60, "fdx router to listen")
        assert "libpaddle" not in maps_of(proc.pid)
        proc.send_signal(sig)
        assert proc.wait(30) == 0, (tmp_path / "router.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
