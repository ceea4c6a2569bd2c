"""Time bounds of issue 21 (docs/security.md, docs/reliability.md), each
replayed against a real ``fdx serve`` with real sockets: a client that
stops reading is cut ``stream_send_timeout_s`` after it stopped, however
much the buffers could still take; a step that runs past
``engine_step_timeout_s`` turns /health unhealthy until it ends; a client
that trickles its request head is closed after ``header_timeout_s``.

The slow steps come from the example plugin's ``slow-step`` logits
processor (tests/plugin_pkg): a request's ``extra_args.sleep_s`` makes each
step that samples for it sleep on the engine thread."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from serve_utils import API_KEY, ready_server, wait_for

pytestmark = pytest.mark.slow

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _slow_server(tmp, tiny_model, **server):
    return ready_server(tmp, server, model={"model": tiny_model, "max_model_len": 4096},
                        cache={"block_size": 16, "num_kv_blocks": 1024},
                        decoding={"logits_processors": ["slow-step"]})


def _aborts(srv) -> float:
    return sum(v for k, v in srv.metrics().items() if 'finished_reason="abort"' in k)


def _idle(srv) -> bool:
    m = srv.metrics()
    return (m["fdx:num_requests_running"] == 0 and m["fdx:num_requests_waiting"] == 0
            and m["fdx:kv_cache_free_blocks"] == m["fdx:kv_cache_total_blocks"])


def _post(sock: socket.socket, body: dict) -> None:
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(raw)).encode()
                 + b"\r\n\r\n" + raw)


# -- 1. a slow reader is cut from the moment it stops reading ---------------------------------

SEND_TIMEOUT = 3.0


def test_a_client_that_stops_reading_is_cut_from_when_it_stopped(tmp_path, tiny_model, example_plugin_installed):
    """A raw client (4 KiB receive buffer) reads the start of a 4-sequence
    stream, then stops. The stream is slow (about 50 steps a second), so the
    server's socket buffers could take its output for a minute or more: the
    cut must still come ``stream_send_timeout_s`` after the client stopped,
    its 4 sequences aborted and every KV block free again. (Before, the
    timeout ran only once the buffers were full: 135-143 s in issue 21.)"""
    srv = _slow_server(tmp_path, tiny_model, stream_send_timeout_s=SEND_TIMEOUT)
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        before = _aborts(srv)
        slow.connect(("127.0.0.1", srv.port))
        _post(slow, {"prompt": [11, 12, 13], "max_tokens": 4000, "ignore_eos": True, "n": 4, "stream": True,
                     "extra_args": {"sleep_s": 0.02}})
        got = b""
        slow.settimeout(30)
        while got.count(b"data: {") < 40:             # it reads for a while ...
            chunk = slow.recv(4096)
            assert chunk, got[-500:]
            got += chunk
        stopped = time.monotonic()                     # ... then stops
        wait_for(lambda: _aborts(srv) - before >= 4, timeout=SEND_TIMEOUT + 60,
                 what="the unread stream to be cut off and its 4 sequences aborted")
        cut_after = time.monotonic() - stopped
        wait_for(lambda: _idle(srv), timeout=10, what="its KV blocks to be freed")
        print(f"\nstream_send_timeout_s={SEND_TIMEOUT:g}: cut {cut_after:.2f} s after the client stopped reading")
        assert SEND_TIMEOUT - 0.5 <= cut_after <= SEND_TIMEOUT + 3.0, cut_after
        assert "took no stream data" in srv.log()
        with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": [5], "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        slow.close()
        srv.stop()


# -- 2. a step longer than its timeout is seen ----------------------------------------------

def test_a_step_past_its_timeout_turns_health_unhealthy_until_it_ends(tmp_path, tiny_model,
                                                                       example_plugin_installed):
    """One request whose only sampling step sleeps 5 s on the engine thread
    (the heartbeat thread keeps beating meanwhile): /health answers 503
    ``engine_step_timeout`` once the step has run past
    ``engine_step_timeout_s`` (1.5 s), the log and ``fdx:engine_long_steps``
    say so, and /health is 200 again once the step ends."""
    srv = _slow_server(tmp_path, tiny_model, engine_step_timeout_s=1.5, engine_heartbeat_interval_s=0.25)
    try:
        answers: list[tuple[float, int, str | None]] = []
        done = threading.Event()
        result: dict = {}

        def slow_request():
            with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=60) as http:
                result["r"] = http.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 1,
                                                                 "extra_args": {"sleep_s": 5}})
            done.set()
        t0 = time.monotonic()
        worker = threading.Thread(target=slow_request, daemon=True)
        worker.start()
        with httpx.Client(base_url=srv.base_url, timeout=10) as http:
            while not done.is_set() or time.monotonic() - t0 < 8:
                r = http.get("/health")
                code = r.json()["error"]["code"] if r.status_code != 200 else None
                answers.append((time.monotonic() - t0, r.status_code, code))
                time.sleep(0.2)
        worker.join(30)
        assert result["r"].status_code == 200, result["r"].text
        unhealthy = [t for t, status, code in answers if status == 503]
        assert unhealthy, answers
        assert {code for _, status, code in answers if status == 503} == {"engine_step_timeout"}, answers
        assert answers[0][1] == 200, answers                     # not before the step is long
        assert 1.5 <= unhealthy[0] <= 4.0, answers
        assert answers[-1][1] == 200, answers                    # and healthy again after it
        print(f"\n/health 503 from {unhealthy[0]:.1f} s to {unhealthy[-1]:.1f} s of a 5 s step "
              "(engine_step_timeout_s=1.5)")
        log = srv.log()
        assert "an engine step has run for" in log and "the long engine step ended" in log, log
        assert srv.metrics()["fdx:engine_long_steps"] >= 1       # a busy machine may make another step long too
    finally:
        srv.stop()


# -- 3. a trickled request head is cut off --------------------------------------------------

FD_LIMIT = 256
HEAD_TIMEOUT = 2.0


def _low_fd_limit() -> None:
    import resource
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def test_clients_trickling_headers_are_closed_after_the_header_timeout(tmp_path, tiny_model):
    """300 clients against a server whose descriptor limit is 256, each
    sending one header line every half second, never ending the head: each
    is closed ``header_timeout_s`` after it connected (with a 408, or the
    503 of the connection cap), so their slots come free while they still
    trickle and a fresh client is served; the log stays a few lines long."""
    srv = ready_server(tmp_path, {"header_timeout_s": HEAD_TIMEOUT}, _low_fd_limit,
                       model={"model": tiny_model, "max_model_len": 512})
    socks: list[socket.socket] = []
    try:
        log0 = len(srv.log_path.read_text().splitlines())
        t0 = time.monotonic()
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        open_ = set(range(len(socks)))
        closed_at: dict[int, float] = {}
        answers: dict[int, bytes] = {}
        while open_ and time.monotonic() - t0 < HEAD_TIMEOUT + 10:
            time.sleep(0.5)
            for i in list(open_):
                s = socks[i]
                try:
                    s.sendall(b"X-Trickle: y\r\n")
                    s.setblocking(False)
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    finally:
                        s.setblocking(True)
                    answers[i] = data
                except OSError:
                    pass
                closed_at[i] = time.monotonic() - t0
                open_.discard(i)
        assert not open_, f"{len(open_)} trickling clients still open after {HEAD_TIMEOUT + 10:g} s"
        latest = max(closed_at.values())
        timed_out = sum(a.startswith(b"HTTP/1.1 408") for a in answers.values())
        print(f"\n300 trickling clients: all closed within {latest:.1f} s (header_timeout_s={HEAD_TIMEOUT:g}); "
              f"{timed_out} answered 408")
        assert latest <= HEAD_TIMEOUT + 5, latest
        assert timed_out >= 100, answers
        r = httpx.get(srv.base_url + "/health", timeout=15)
        assert r.status_code == 200, r.text
        lines = srv.log_path.read_text().splitlines()[log0:]
        assert len(lines) < 20, "\n".join(lines[:40])
        with httpx.Client(base_url=srv.base_url, headers=HEADERS, timeout=60) as http:
            assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        for s in socks:
            s.close()
        srv.stop()
