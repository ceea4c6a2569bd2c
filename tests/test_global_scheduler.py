"""The global (Redis) request scheduler: two mixed ``fdx serve`` instances
share one queue in a real ``redis-server`` (Debian's package, installed
here when missing); a burst larger than one instance's max_num_seqs, an
instance killed mid-burst, Redis restarted mid-burst; and an attacker who
can write to Redis (docs/security.md#the-global-schedulers-redis)."""
from __future__ import annotations

import codecs
import concurrent.futures as cf
import os
import re
import shutil
import signal
import subprocess
import time

import msgspec
import openai
import pytest
import redis

from serve_utils import API_KEY, ServerProcess, free_port, stop_all

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SECRET = "test-shared-secret"


def system_binary(name: str, package: str) -> str:
    """``name`` on PATH, apt-installing ``package`` for the session when it is missing."""
    path = shutil.which(name)
    if path is None:                              # for the session only: purged at its end
        from conftest import apt_install
        apt_install(package)
        path = shutil.which(name)
    assert path, f"{name} could not be installed"
    return path


def _redis_binary() -> str:
    return system_binary("redis-server", "redis-server")


class RedisServer:
    def __init__(self, binary: str, tmp, port: int, password: str | None = None):
        self.binary, self.tmp, self.port, self.password = binary, tmp, port, password
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)

    def start(self) -> None:
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.tmp), *auth],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    """The instances' shared secret, from the environment (the servers inherit it)."""
    monkeypatch.setenv("FDX_SCHEDULER_SECRET", SECRET)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    srv = RedisServer(_redis_binary(), tmp_path_factory.mktemp("redis"), free_port())
    srv.start()
    yield srv
    srv.stop()


def global_server(tmp_path_factory, model, redis_url: str, max_num_seqs: int = 2, **settings) -> ServerProcess:
    plugins = {"request_scheduler": {"global": {"url": redis_url, "ttl_s": 20, "heartbeat_s": 0.5, **settings}}}
    return ServerProcess(tmp_path_factory.mktemp("g"), {"served_model_name": "tiny"},
                         model={"model": str(model), "max_model_len": 256},
                         scheduler={"request_scheduler": "global", "max_num_seqs": max_num_seqs}, plugins=plugins)


def start_pair(tmp_path_factory, model, redis_url: str, n: int = 2, max_num_seqs: int = 2,
               **settings) -> list[ServerProcess]:
    servers = [global_server(tmp_path_factory, model, redis_url, max_num_seqs, **settings) for _ in range(n)]
    try:
        for s in servers:
            s.wait_ready()
    except Exception:
        stop_all(servers)
        raise
    return servers


def ask(url: str, i: int, stream: bool = False) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    prompt = f"Request number {i}: " + "word " * (i % 5)
    if stream:
        return "".join(ch.choices[0].text for ch in c.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True) if ch.choices)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def reference(tiny_checkpoints, tmp_path_factory):
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    srv = ServerProcess(tmp_path_factory.mktemp("ref"), {"served_model_name": "tiny"},
                        model={"model": str(model), "max_model_len": 256})
    try:
        srv.wait_ready()
        yield {i: ask(srv.base_url, i) for i in range(12)}
    finally:
        srv.stop()


def pulls(srv: ServerProcess) -> float:
    return srv.metrics().get("fdx:global_pulls_total", 0.0)


def test_two_instances_share_a_burst_and_survive_one_dying(tiny_checkpoints, tmp_path_factory, redis_server,
                                                           reference):
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    a, b = start_pair(tmp_path_factory, model, redis_server.url)
    try:
        # a burst of 12 (6x one instance's max_num_seqs), all sent to instance a
        with cf.ThreadPoolExecutor(12) as pool:
            futs = {i: pool.submit(ask, a.base_url, i, i % 2 == 0) for i in range(12)}
            got = {i: f.result() for i, f in futs.items()}
        assert got == reference                        # each completed once, with its own answer
        pa, pb = pulls(a), pulls(b)
        assert pa + pb == 12 and pa > 0 and pb > 0      # both took a share

        # kill b mid-burst: its jobs go back to the queue and a finishes them
        with cf.ThreadPoolExecutor(12) as pool:
            futs = {i: pool.submit(ask, a.base_url, i) for i in range(12)}
            deadline = time.monotonic() + 30
            while pulls(b) == pb and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(b.engine_pid(), signal.SIGKILL)
            b.proc.kill()
            got = {i: f.result() for i, f in futs.items()}
        assert got == reference
        m = a.metrics()
        assert m["fdx:global_requeued_total"] >= 1
        assert m["fdx:kv_cache_free_blocks"] == m["fdx:kv_cache_total_blocks"]
    finally:
        stop_all([a, b])


def test_a_redis_restart_mid_burst_ends_every_request(tiny_checkpoints, tmp_path_factory, redis_server, reference):
    """Outcome stated in plugins/schedulers/global_redis.py: Redis keeps no
    data across the restart here, so queued jobs are lost; their requests
    end with an error within ttl_s (2 s here: the default 20 is a wait and
    proves no more); those already in an engine complete. Nothing hangs."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    (a,) = start_pair(tmp_path_factory, model, redis_server.url, n=1, ttl_s=2.0)
    r = redis_server.client()
    try:
        with cf.ThreadPoolExecutor(10) as pool:
            futs = {i: pool.submit(ask, a.base_url, i) for i in range(10)}
            wait_for(lambda: r.llen("fdx:queue") > 0, "a job queued")          # mid-burst
            redis_server.stop()
            time.sleep(1.0)
            redis_server.start()
            outcomes = {}
            for i, f in futs.items():
                try:
                    outcomes[i] = f.result(timeout=90)
                except openai.APIStatusError as e:
                    outcomes[i] = e.status_code
        assert all(v == reference[i] or v == 503 for i, v in outcomes.items()), outcomes
        # and the instance still serves afterwards
        assert ask(a.base_url, 3) == reference[3]
    finally:
        a.stop()


# -- an attacker who can read and write the Redis ---------------------------------------------
def fields(raw: bytes) -> dict:
    """A job's or result's fields as Redis holds them (sealed: [mac, body])."""
    obj = msgspec.msgpack.decode(raw)
    return msgspec.msgpack.decode(obj[1]) if isinstance(obj, list) else obj


def relabel(raw: bytes, request_id: str) -> bytes:
    """``raw`` with its request id changed (the MAC, if any, kept)."""
    obj = msgspec.msgpack.decode(raw)
    if isinstance(obj, list):
        return msgspec.msgpack.encode([obj[0], relabel(obj[1], request_id)])
    return msgspec.msgpack.encode({**obj, "request_id": request_id})


def occupy(url: str) -> cf.Future:
    """A long request that holds a max_num_seqs=1 instance, so the next one waits in the queue."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return cf.ThreadPoolExecutor(1).submit(c.completions.create, model="tiny", prompt="Occupy " * 8,
                                           max_tokens=200, temperature=0)


def queued_job(r: redis.Redis, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = r.lrange("fdx:queue", 0, -1)
        if jobs:
            return fields(jobs[0])
        time.sleep(0.005)
    raise AssertionError("no job showed up in the queue")


@pytest.fixture(scope="module")
def lone(tiny_checkpoints, tmp_path_factory, redis_server):
    """One instance with max_num_seqs 1 (a second request waits in the
    queue), shared by the attacker's tests: each counts its own rejections."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FDX_SCHEDULER_SECRET", SECRET)
        (a,) = start_pair(tmp_path_factory, tiny_checkpoints["LlamaForCausalLM"][0], redis_server.url, 1, 1)
    try:
        yield a
    finally:
        a.stop()


def rejected(srv: ServerProcess) -> float:
    return srv.metrics().get("fdx:global_messages_rejected_total", 0.0)


def test_a_result_forged_in_redis_is_dropped_and_the_real_answer_arrives(lone, redis_server, reference):
    """The attacker reads the victim's queued job (request id, origin) and
    pushes a finished result for it, unsealed and with a made-up MAC."""
    a, r = lone, redis_server.client()
    before, logged = rejected(a), a.log().count("dropped a result not sealed")
    busy = occupy(a.base_url)
    with cf.ThreadPoolExecutor(1) as pool:
        victim = pool.submit(ask, a.base_url, 5)
        job = queued_job(r)
        forged = {"type": "result", "request_id": job["request_id"], "origin": job["origin"],
                  "executor": job["origin"], "seq": 0, "attempt": 0, "offset": 0,
                  "token_ids": [300, 301, 302, 303], "finish_reason": "stop"}
        key = f"fdx:results:{job['origin']}"
        r.rpush(key, msgspec.msgpack.encode(forged))
        r.rpush(key, msgspec.msgpack.encode([b"\0" * 32, msgspec.msgpack.encode(forged)]))
        assert victim.result() == reference[5]
    busy.result()
    assert rejected(a) - before == 2
    assert a.log().count("dropped a result not sealed") - logged == 1          # logged once


class Monitor:
    """Records the arguments of every RPUSH Redis executes (MONITOR)."""

    def __init__(self, r: redis.Redis):
        self.conn = r.connection_pool.get_connection("MONITOR")
        self.conn.send_command("MONITOR")
        assert self.conn.read_response() in (b"OK", "OK")
        self.pushes: list[list[bytes]] = []
        self.stop = False
        self.thread = cf.ThreadPoolExecutor(1).submit(self._run)

    def _run(self) -> None:
        while not self.stop:
            if self.conn.can_read(timeout=0.1):
                line = self.conn.read_response()
                line = line.encode() if isinstance(line, str) else line
                args = [codecs.escape_decode(a)[0] for a in re.findall(rb'"((?:[^"\\]|\\.)*)"', line)]
                if args and args[0].upper() == b"RPUSH":
                    self.pushes.append(args[1:])

    def close(self) -> list[list[bytes]]:
        self.stop = True
        self.thread.result()
        self.conn.disconnect()
        return self.pushes


def test_a_genuine_result_replayed_for_another_request_is_dropped(lone, redis_server, reference):
    """The attacker records the genuine results of one request (MONITOR) and
    replays them, as they are and relabelled, while another one waits."""
    assert reference[1] != reference[2]
    a, r = lone, redis_server.client()
    before = rejected(a)
    monitor = Monitor(r)
    assert ask(a.base_url, 1) == reference[1]
    recorded = [(key, value) for key, value in monitor.close() if key.startswith(b"fdx:results:")]
    assert recorded
    busy = occupy(a.base_url)
    with cf.ThreadPoolExecutor(1) as pool:
        victim = pool.submit(ask, a.base_url, 2)
        job = queued_job(r)
        for key, value in recorded:
            r.rpush(key, value)                                  # for a finished request: ignored
            r.rpush(key, relabel(value, job["request_id"]))      # for the victim: the MAC does not fit
        assert victim.result() == reference[2]
    busy.result()
    assert rejected(a) - before == len(recorded)


def test_a_redis_password_is_used_and_its_absence_named(tiny_checkpoints, tmp_path_factory, monkeypatch,
                                                        reference):
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    srv = RedisServer(_redis_binary(), tmp_path_factory.mktemp("redis-auth"), free_port(), password="s3cret-pw")
    srv.start()
    try:
        bare = global_server(tmp_path_factory, model, srv.url)
        with pytest.raises(RuntimeError, match=r"refused the login.*plugins\.request_scheduler\.global\.password"):
            bare.wait_ready()
        assert "s3cret-pw" not in bare.log()
        monkeypatch.setenv("FDX_REDIS_PASSWORD", "s3cret-pw")
        good = global_server(tmp_path_factory, model, srv.url)
        try:
            good.wait_ready()
            assert ask(good.base_url, 0) == reference[0]
        finally:
            good.stop()
    finally:
        srv.stop()


# -- TLS (rediss://) -----------------------------------------------------------------------

def make_ca_and_server_cert(folder) -> dict[str, str]:
    """A throw-away CA, and a certificate it signs for 127.0.0.1 (openssl CLI)."""
    openssl = system_binary("openssl", "openssl")
    f = {n: str(folder / n) for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt", "san.ext")}

    def run(*args):
        subprocess.run([openssl, *args], check=True, capture_output=True, timeout=60)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f["ca.key"], "-out", f["ca.crt"],
        "-days", "2", "-subj", "/CN=fdx test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f["server.key"], "-out", f["server.csr"],
        "-subj", "/CN=127.0.0.1")
    (folder / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", f["server.csr"], "-CA", f["ca.crt"], "-CAkey", f["ca.key"], "-CAcreateserial",
        "-out", f["server.crt"], "-days", "2", "-extfile", f["san.ext"])
    os.chmod(f["server.key"], 0o600)
    return f


class TLSRedisServer(RedisServer):
    """redis-server speaking TLS only (``--port 0 --tls-port``), its
    certificate signed by a CA of the test's own."""

    def __init__(self, binary: str, tmp, port: int, certs: dict[str, str]):
        super().__init__(binary, tmp, port)
        self.certs = certs
        self.url = f"rediss://127.0.0.1:{port}/0"

    def client(self, ca: str | None = "default") -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, ssl=True, ssl_cert_reqs="required", socket_timeout=30,
                           ssl_ca_certs=self.certs["ca.crt"] if ca == "default" else ca)

    def start(self) -> None:
        c = self.certs
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1",
             "--tls-cert-file", c["server.crt"], "--tls-key-file", c["server.key"], "--tls-ca-cert-file",
             c["ca.crt"], "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(self.tmp)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                if "tls" in out.lower() and ("not supported" in out.lower() or "bad directive" in out.lower()):
                    pytest.skip(f"this redis-server has no TLS support: {out[-300:]}")
                raise AssertionError(f"redis-server with TLS did not start:\n{out[-2000:]}")
            try:
                self.client().ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server with TLS did not answer"
                time.sleep(0.1)


def test_the_global_scheduler_over_tls_and_a_client_without_the_ca_refused(tiny_checkpoints, tmp_path_factory,
                                                                           reference):
    """Two instances share a burst through a redis-server that speaks only
    TLS, trusting its certificate through ``ssl_ca_certs`` (the test's own
    CA), and answer as a lone instance does. A Redis client without that CA
    is refused the connection (certificate verify failed), and an fdx
    instance without it does not start, saying why."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    tmp = tmp_path_factory.mktemp("redis-tls")
    srv = TLSRedisServer(_redis_binary(), tmp, free_port(), make_ca_and_server_cert(tmp))
    srv.start()
    try:
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            srv.client(ca=None).ping()            # the system's CAs do not know the test's CA
        plain = redis.Redis(host="127.0.0.1", port=srv.port, socket_timeout=5)
        with pytest.raises(redis.ConnectionError):
            plain.ping()                          # and no plain-text talk on the TLS port
        ca = srv.certs["ca.crt"]
        servers = [global_server(tmp_path_factory, model, srv.url, ssl_ca_certs=ca) for _ in range(2)]
        try:
            for s in servers:
                s.wait_ready()
            # which instance pulls a job is a race: on a busy machine one may drain a whole burst
            # before the other's pull loop runs. Bursts until both have pulled (one, nearly always),
            # each answering as a lone instance does
            for burst in range(1, 6):
                with cf.ThreadPoolExecutor(8) as pool:
                    got = dict(zip(range(8), pool.map(lambda i: ask(servers[i % 2].base_url, i), range(8))))
                assert got == {i: reference[i] for i in range(8)}
                if all(pulls(s) > 0 for s in servers):
                    break
            assert sum(pulls(s) for s in servers) >= 8 * burst
            assert all(pulls(s) > 0 for s in servers), [pulls(s) for s in servers]
        finally:
            stop_all(servers)
        bare = global_server(tmp_path_factory, model, srv.url)
        with pytest.raises(RuntimeError, match=r"cannot be reached.*certificate verify failed"):
            bare.wait_ready()
    finally:
        srv.stop()


# -- a queue is not a loss (issue 35 item 3) ------------------------------------------------------
def long_request(url: str) -> cf.Future:
    """A request that holds a max_num_seqs=1 instance for its whole length (no early EOS)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    return cf.ThreadPoolExecutor(1).submit(c.completions.create, model="tiny", prompt="Occupy " * 8,
                                           max_tokens=200, temperature=0, extra_body={"ignore_eos": True})


def submit(fn, *args) -> cf.Future:
    return cf.ThreadPoolExecutor(1).submit(fn, *args)


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def hold_queued(srv: ServerProcess, r: redis.Redis, prefix: str, seconds: float):
    """One long request running on ``srv`` (max_num_seqs 1), one short one
    (``ask`` number 3) queued behind it; then the engine paused (SIGSTOP) for
    ``seconds``, so that the short one stays queued that long whatever the
    machine's speed (the instance itself, its heartbeat, keeps running)."""
    occupier = long_request(srv.base_url)
    wait_for(lambda: r.llen(f"{prefix}:processing:{srv.instance_id}") == 1, "the long request to start")
    os.kill(srv.engine_pid(), signal.SIGSTOP)   # before the short one is sent: a fast machine (or a
    try:                                        # slow wait here) finished the long one first and ran it
        queued = submit(ask, srv.base_url, 3)
        wait_for(lambda: r.llen(f"{prefix}:queue") == 1, "the second request to be queued")
        time.sleep(seconds)
    finally:
        os.kill(srv.engine_pid(), signal.SIGCONT)
    return occupier, queued


def test_a_request_queued_past_ttl_waits_for_a_slot(tiny_checkpoints, tmp_path_factory, redis_server, reference):
    """Before: a request queued (every instance busy) longer than ttl_s got a
    503 "lost the request" though nothing was lost. Now it waits for a slot."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    r = redis_server.client()
    patient = global_server(tmp_path_factory, model, redis_server.url, 1, ttl_s=0.3, prefix="patient",
                            instance_id="patient-a")
    patient.instance_id = "patient-a"
    try:
        patient.wait_ready()
        occupier, queued = hold_queued(patient, r, "patient", 3.0)      # 10 x ttl_s in the queue
        assert len(occupier.result(timeout=120).choices[0].text) > 0
        assert queued.result(timeout=120) == reference[3]
    finally:
        patient.stop()


def test_a_request_queued_past_the_queue_timeout_is_told_so(tiny_checkpoints, tmp_path_factory, redis_server,
                                                            reference):
    """It waits up to queue_timeout_s, then gets a 503 saying it was not
    admitted in time, and leaves the queue."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    r = redis_server.client()
    strict = global_server(tmp_path_factory, model, redis_server.url, 1, ttl_s=0.3, queue_timeout_s=1.0,
                           prefix="strict", instance_id="strict-a")
    strict.instance_id = "strict-a"
    try:
        strict.wait_ready()
        occupier, queued = hold_queued(strict, r, "strict", 3.0)        # 3 x queue_timeout_s
        with pytest.raises(openai.APIStatusError) as e:
            queued.result(timeout=120)
        assert e.value.status_code == 503
        assert "did not admit the request in time" in str(e.value) and "queue_timeout_s=1" in str(e.value)
        assert r.llen("strict:queue") == 0                 # it left the queue: no instance runs it later
        assert len(occupier.result(timeout=120).choices[0].text) > 0
        assert ask(strict.base_url, 4) == reference[4]     # and the instance serves on
    finally:
        strict.stop()


def test_a_job_lost_with_redis_or_with_its_instance_says_so(tiny_checkpoints, tmp_path_factory, redis_server,
                                                             reference):
    """Redis restarted without persistence while a job was queued: that
    request is told Redis restarted, and the one running in an engine
    completes (its instance puts it back). Then an instance dies with a job
    and no attempt left (max_attempts 1): its request is told which
    instance is gone."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    a = global_server(tmp_path_factory, model, redis_server.url, 1, ttl_s=0.3, prefix="lost", instance_id="lost-a",
                      max_attempts=1)
    a.instance_id = "lost-a"
    b = None
    try:
        a.wait_ready()
        occupier = long_request(a.base_url)
        r = redis_server.client()
        wait_for(lambda: r.llen("lost:processing:lost-a") == 1, "the long request to start")
        queued = submit(ask, a.base_url, 3)
        wait_for(lambda: r.llen("lost:queue") == 1, "the second request to be queued")
        os.kill(a.engine_pid(), signal.SIGSTOP)           # so the queued job is still queued at the restart
        try:
            redis_server.stop()
            redis_server.start()
            time.sleep(1.0)
        finally:
            os.kill(a.engine_pid(), signal.SIGCONT)
        with pytest.raises(openai.APIStatusError) as e:
            queued.result(timeout=120)
        assert e.value.status_code == 503
        assert "lost the request" in str(e.value) and "restarted (its run_id changed)" in str(e.value)
        assert len(occupier.result(timeout=120).choices[0].text) > 0    # not lost: it was in an engine

        b = global_server(tmp_path_factory, model, redis_server.url, 1, ttl_s=0.3, prefix="lost",
                          instance_id="lost-b", max_attempts=1)
        b.wait_ready()
        r = redis_server.client()
        first = long_request(a.base_url)
        wait_for(lambda: r.llen("lost:processing:lost-a") + r.llen("lost:processing:lost-b") == 1, "a start")
        second = long_request(a.base_url)
        wait_for(lambda: r.llen("lost:processing:lost-a") == 1 and r.llen("lost:processing:lost-b") == 1,
                 "one long request on each instance")
        os.kill(b.engine_pid(), signal.SIGKILL)
        b.proc.kill()
        outcomes = []
        for f in (first, second):
            try:
                outcomes.append(len(f.result(timeout=120).choices[0].text) > 0)
            except openai.APIStatusError as err:
                outcomes.append((err.status_code, str(err)))
        lost = [o for o in outcomes if o is not True]
        assert len(lost) == 1, outcomes                    # the one on a completes
        status, message = lost[0]
        assert status == 503 and "lost the request: the instance running it (lost-b) is gone" in message
    finally:
        stop_all([a, b])


def test_a_held_job_with_no_result_for_result_timeout_is_given_up(tiny_checkpoints, tmp_path_factory,
                                                                   redis_server):
    """The backstop for a job a live instance holds but never answers (its
    engine paused here): a 503 naming the instance after result_timeout_s."""
    model = tiny_checkpoints["LlamaForCausalLM"][0]
    r = redis_server.client()
    srv = global_server(tmp_path_factory, model, redis_server.url, 1, ttl_s=0.3, result_timeout_s=1.0,
                        prefix="silent", instance_id="silent-a")
    try:
        srv.wait_ready()
        held = long_request(srv.base_url)
        wait_for(lambda: r.llen("silent:processing:silent-a") == 1, "the request to start")
        os.kill(srv.engine_pid(), signal.SIGSTOP)
        try:
            with pytest.raises(openai.APIStatusError) as e:
                held.result(timeout=120)
        finally:
            os.kill(srv.engine_pid(), signal.SIGCONT)
        assert e.value.status_code == 503
        assert "the instance holding it (silent-a) sent no result" in str(e.value)
    finally:
        srv.stop()
