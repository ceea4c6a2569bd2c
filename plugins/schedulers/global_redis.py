"""Request-level schedulers: ``local`` (this server's engine) and ``global``:
several instances share one request queue and their results over Redis.

``scheduler.request_scheduler: global`` with settings under ``plugins:
{scheduler: {global: {url: redis://host:6379/0, ...}}}``. Each server that
receives an HTTP request pushes a job to ``<prefix>:queue``; every instance
pulls jobs while it has fewer than ``scheduler.max_num_seqs`` of them in its
engine (a reliable queue: ``BLMOVE`` into ``<prefix>:processing:<instance>``),
runs them, and pushes the token deltas to ``<prefix>:results:<origin>``,
which the receiving server reads and streams. Messages are msgpack
(msgspec), never pickle.

Redis is not trusted with the answers (docs/security.md#the-global-schedulers-redis):
every job and result is sealed with an HMAC-SHA256 under ``secret`` (the
same on every instance; or ``$FDX_SCHEDULER_SECRET``). A result names its
request, the origin it is for, the instance that ran it and its sequence
number in that run; the origin takes a request's results from one instance
per attempt, in sequence, so a forged or replayed one is dropped (counted in
``fdx:global_messages_rejected``, logged once). Prompts are not encrypted:
whoever reads Redis reads the token ids. Login and TLS (``password``,
``username``, ``ssl``, ``ssl_*``, or ``redis://user:pass@host``,
``rediss://``) go to redis-py as they are.

Faults:
- an instance that dies stops refreshing ``<prefix>:alive:<instance>``
  (``heartbeat_s`` x 3); any other instance then moves its jobs back to the
  queue, where another pulls them (the receiving server skips the tokens it
  already streamed, checking they are the same: greedy and seeded requests
  continue seamlessly, an unseeded sampled one that diverges ends with an
  error). After ``max_attempts`` a job fails with an error instead.
- a server stopped with SIGTERM hands its jobs back to the queue at once.
- a request with no news for ``ttl_s`` is looked for in Redis: a job still
  in the queue waits (every instance is busy), up to ``queue_timeout_s``
  from its arrival, then ends with a 503 saying it was not admitted in
  time (and leaves the queue); a job an instance holds keeps waiting (the
  watchers hand a dead instance's jobs back), unless no result came for
  ``result_timeout_s`` (a 503 naming that instance); a job in neither, for longer
  than a grace of 3 heartbeats plus a second, is lost, and its request
  ends with a 503 saying why: Redis restarted (its ``run_id`` changed)
  without keeping it, or the instance that ran it is gone. A job whose
  instances died ``max_attempts`` times ends with a 503 naming the last one.
  Redis going away is retried every half second; jobs already in an engine
  finish and their results are delivered once Redis is back (each
  instance puts the jobs it runs back in its ``processing`` list when it
  sees Redis restarted).
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
import time

import msgspec

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import RequestScheduler
from fdx.core.messages import EngineDeadError, EngineRejected, SeqDelta
from fdx.core.sampling_params import SamplingParams

log = logging.getLogger("fdx.scheduler.global")


class Sealed(msgspec.Struct, array_like=True):
    """What Redis holds: a message and its HMAC under the shared secret."""
    mac: bytes
    body: bytes


class Job(msgspec.Struct, tag="job"):
    request_id: str
    origin: str                          # the instance whose client waits for it
    prompt_token_ids: list[int]
    params: SamplingParams               # as the origin made it (EngineClient.add)
    trace: dict = {}                     # x-request-id, traceparent, tracestate (EngineClient.add)


class Result(msgspec.Struct, tag="result"):
    request_id: str
    origin: str                          # the instance it is for
    executor: str                        # the instance that ran it
    seq: int                             # 0, 1, 2, ... in this attempt
    attempt: int                         # a retried job's deltas restart at offset 0
    offset: int                          # index of token_ids[0] in the output
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    error: str | None = None             # rejected by the engine (a 400)
    fatal: str | None = None             # cannot be served (a 503)


_enc = msgspec.msgpack.Encoder()
_sealed_dec = msgspec.msgpack.Decoder(Sealed)
_job_dec = msgspec.msgpack.Decoder(Job)
_res_dec = msgspec.msgpack.Decoder(Result)
JOB, RESULT = b"fdx-global-job\0", b"fdx-global-result\0"     # HMAC domain tags

SETTINGS = {"url", "prefix", "ttl_s", "queue_timeout_s", "result_timeout_s", "heartbeat_s", "max_attempts", "instance_id", "secret",
            "username", "password", "ssl", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"}
SECRET_HELP = "set plugins.request_scheduler.global.secret (or $FDX_SCHEDULER_SECRET), the same on every instance"
PASSWORD_HELP = ("set plugins.request_scheduler.global.password (or $FDX_REDIS_PASSWORD; username / $FDX_REDIS_USERNAME "
                 "for an ACL user), or put it in the url: redis://user:password@host:6379/0")


def _mac(key: bytes, kind: bytes, body: bytes) -> bytes:
    return hmac.new(key, kind + body, hashlib.sha256).digest()


def seal(key: bytes, kind: bytes, msg) -> bytes:
    body = _enc.encode(msg)
    return _enc.encode(Sealed(_mac(key, kind, body), body))


def unseal(key: bytes, kind: bytes, raw: bytes, decoder):
    """The message sealed in ``raw`` under ``key``, or None when it is not one
    (not sealed, a wrong MAC, another kind, undecodable)."""
    try:
        sealed = _sealed_dec.decode(raw)
        if not hmac.compare_digest(sealed.mac, _mac(key, kind, sealed.body)):
            return None
        return decoder.decode(sealed.body)
    except msgspec.DecodeError:
        return None


def redact(url: str) -> str:
    """``url`` without its password, for messages."""
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", url)


def redis_options(url: str, settings: dict) -> tuple[str, dict]:
    """The url and keyword arguments for ``redis.asyncio.from_url``: login
    and TLS settings (a password in the url wins over the setting)."""
    opts = {}
    username = settings.get("username") or os.environ.get("FDX_REDIS_USERNAME")
    password = settings.get("password") or os.environ.get("FDX_REDIS_PASSWORD")
    if username:
        opts["username"] = str(username)
    if password:
        opts["password"] = str(password)
    if settings.get("ssl") and url.startswith("redis://"):
        url = "rediss://" + url[len("redis://"):]
    if url.startswith("rediss://"):
        opts["ssl_cert_reqs"] = "required"
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            if settings.get(name):
                opts[name] = str(settings[name])
    elif any(settings.get(n) for n in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")):
        raise ValueError("ssl_ca_certs / ssl_certfile / ssl_keyfile need ssl: true or a rediss:// url")
    return url, opts


class LocalScheduler(RequestScheduler):
    """The default: requests run in this server's engine (never built: no wrapping)."""
    wraps = False

    def add(self, request_id, prompt_token_ids, params, callback, trace=None) -> None:
        self.engine.add(request_id, prompt_token_ids, params, callback, trace)

    def abort(self, request_ids) -> None:
        self.engine.abort(request_ids)


class _Pending:
    __slots__ = ("callback", "tokens", "attempt", "executor", "seq", "last", "raw", "added", "admitted",
                 "missing_since", "holder", "run_id", "heard")

    def __init__(self, callback, raw: bytes, run_id: str | None = None):
        self.callback, self.raw = callback, raw
        self.tokens: list[int] = []
        self.attempt = 0
        self.executor: str | None = None     # the instance whose results this attempt takes
        self.seq = -1                        # the last result taken from it
        self.last = time.monotonic()         # the last news: a result, or the job seen in Redis
        self.added = self.last
        self.heard = self.last               # the last result (or the arrival)
        self.admitted = False                # an instance took the job (a result, or seen held)
        self.missing_since: float | None = None   # the job was in no queue and no instance held it
        self.holder: str | None = None       # the instance last seen holding the job
        self.run_id = run_id                 # Redis's run_id when the job was pushed

    def takes(self, res: Result) -> bool:
        """Whether ``res`` continues this request: the first result of a
        newer attempt, or the next one from the instance running this one."""
        if res.attempt > self.attempt or self.executor is None:
            ok = res.seq == 0
        else:
            ok = res.executor == self.executor and res.seq == self.seq + 1
        if ok:
            self.attempt, self.executor, self.seq = res.attempt, res.executor, res.seq
        return ok


class _Running:
    __slots__ = ("raw", "job", "attempt", "sent", "seq")

    def __init__(self, raw: bytes, job: Job, attempt: int):
        self.raw, self.job, self.attempt = raw, job, attempt
        self.sent = 0                        # tokens published
        self.seq = 0                         # results published


class GlobalScheduler(RequestScheduler):
    def __init__(self, settings: dict, context):
        super().__init__(settings, context)
        engine, metrics = self.engine, self.metrics
        bad = set(settings) - SETTINGS
        if bad:
            raise ValueError(f"unknown setting {sorted(bad)[0]!r}; known: {', '.join(sorted(SETTINGS))}")
        try:
            import redis.asyncio  # noqa: F401
        except ImportError:
            raise ValueError("the global scheduler needs the redis client: pip install 'fdx[scaleout]'") from None
        self.local = engine
        self.url, self.redis_options = redis_options(str(settings.get("url", "redis://127.0.0.1:6379/0")), settings)
        secret = settings.get("secret") or os.environ.get("FDX_SCHEDULER_SECRET")
        self.key = str(secret).encode() if secret else None    # checked at start (SECRET_HELP)
        self.prefix = str(settings.get("prefix", "fdx"))
        self.ttl = float(settings.get("ttl_s", 60.0))
        self.queue_timeout = float(settings.get("queue_timeout_s", 600.0))
        self.result_timeout = float(settings.get("result_timeout_s", 600.0))
        self.heartbeat = float(settings.get("heartbeat_s", 1.0))
        self.max_attempts = int(settings.get("max_attempts", 3))
        if min(self.ttl, self.heartbeat, self.queue_timeout, self.result_timeout) <= 0 or self.max_attempts < 1:
            raise ValueError("ttl_s, queue_timeout_s, result_timeout_s and heartbeat_s must be positive, "
                             "max_attempts at least 1")
        self.grace = 3 * self.heartbeat + 1.0          # a job in no list this long is lost
        self.run_id: str | None = None                 # Redis's run_id: another one means it restarted
        self.id = str(settings.get("instance_id") or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
        self.capacity = self.config.scheduler.max_num_seqs
        self.pending: dict[str, _Pending] = {}         # origin side: requests this server received
        self.running: dict[str, _Running] = {}         # executor: jobs in this instance's engine
        self.outbox: asyncio.Queue = asyncio.Queue()   # executor: results to publish, in order
        self.tasks: list[asyncio.Task] = []
        self.stopping = False
        self.rejected_logged = False
        self._metrics(metrics)

    def _metrics(self, metrics) -> None:
        from prometheus_client import Counter, Gauge
        lab, r = ["model_name"], metrics.registry
        self.m_queue = Gauge("fdx:global_queue_length", "Jobs waiting in the global (Redis) queue.", lab,
                             registry=r).labels(**metrics.labels)
        self.m_pulls = Counter("fdx:global_pulls", "Jobs this instance pulled from the global queue.", lab,
                               registry=r).labels(**metrics.labels)
        self.m_requeued = Counter("fdx:global_requeued", "Jobs of dead instances put back in the queue.", lab,
                                  registry=r).labels(**metrics.labels)
        self.m_rejected = Counter("fdx:global_messages_rejected", "Jobs and results read from Redis that were "
                                  "not sealed with the secret, or were replayed.", lab,
                                  registry=r).labels(**metrics.labels)

    def _reject(self, what: str) -> None:
        """Count a forged or replayed message; log the first one."""
        self.m_rejected.inc()
        level = logging.DEBUG if self.rejected_logged else logging.WARNING
        self.rejected_logged = True
        log.log(level, "global scheduler: dropped %s (fdx:global_messages_rejected counts them; "
                "is someone else writing to this Redis?)", what)

    def k(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    # -- lifecycle ---------------------------------------------------------------------
    async def start(self):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import ExponentialBackoff
        from redis.exceptions import ConnectionError, TimeoutError
        from redis.exceptions import AuthenticationError, ResponseError
        if self.key is None:
            raise EngineDeadError(f"the global scheduler needs a shared secret: {SECRET_HELP}")
        ready = await self.local.start()
        # a dropped connection (Redis restarted) is retried on a fresh one, a few times
        self.r = aioredis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2,
                                   retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), 4),
                                   retry_on_error=[ConnectionError, TimeoutError], **self.redis_options)
        try:
            await self.r.ping()
        except Exception as e:
            await self.local.shutdown()
            where = f"the global scheduler: Redis at {redact(self.url)}"
            if isinstance(e, AuthenticationError) or (isinstance(e, ResponseError) and "NOAUTH" in str(e)):
                raise EngineDeadError(f"{where} refused the login ({e}): {PASSWORD_HELP}") from None
            raise EngineDeadError(f"{where} cannot be reached: {e}") from None
        self.run_id = await self._run_id()
        self.tasks = [asyncio.create_task(f()) for f in (self._pull, self._read, self._publish, self._watch)]
        return ready

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Hand the jobs this instance holds back to the queue, then stop."""
        self.stopping = True
        for t in self.tasks:
            t.cancel()
        try:
            await self._drain_outbox()
            for rid in list(self.running):
                raw = self.running.pop(rid).raw
                await self.r.lrem(self.k("processing", self.id), 1, raw)
                await self.r.lpush(self.k("queue"), raw)
            await self.r.delete(self.k("alive", self.id))
        except Exception as e:
            log.warning("global scheduler: could not hand jobs back: %s", e)
        await self.local.shutdown(timeout)
        try:
            await self.r.aclose()
        except Exception:
            pass

    # -- the origin side ------------------------------------------------------------------
    def add(self, request_id, prompt_token_ids, params, callback, trace=None) -> None:
        if self.local.dead or self.stopping:
            raise EngineDeadError("the engine is not running")
        raw = seal(self.key, JOB, Job(request_id, self.id, list(prompt_token_ids), params, dict(trace or {})))
        self.pending[request_id] = _Pending(callback, raw, self.run_id)
        asyncio.get_running_loop().create_task(self._push(request_id, raw))

    async def _push(self, rid: str, raw: bytes) -> None:
        try:
            await self.r.rpush(self.k("queue"), raw)
        except Exception as e:
            p = self.pending.pop(rid, None)
            if p is not None:
                p.callback(EngineDeadError(f"the global scheduler cannot reach Redis: {e}"))

    def abort(self, request_ids) -> None:
        live = [rid for rid in request_ids if self.pending.pop(rid, None) is not None]
        if live:
            asyncio.get_running_loop().create_task(self._abort(live))

    async def _abort(self, ids: list[str]) -> None:
        try:
            pipe = self.r.pipeline()
            for rid in ids:
                pipe.set(self.k("abort", rid), 1, ex=int(self.ttl) + 1)
            await pipe.execute()
        except Exception as e:
            log.warning("global scheduler: abort not recorded: %s", e)

    def finished(self, request_id) -> None:
        self.pending.pop(request_id, None)

    async def _read(self) -> None:
        key = self.k("results", self.id)
        while True:
            try:
                item = await self.r.blpop([key], timeout=0.5)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("global scheduler: results: %s", e)
                await asyncio.sleep(0.5)
                item = None
            if item is not None:
                res = unseal(self.key, RESULT, item[1], _res_dec)
                if res is None or res.origin != self.id:
                    self._reject("a result not sealed with the secret")
                else:
                    self._deliver(res)
            now = time.monotonic()
            for rid, p in list(self.pending.items()):
                overdue = not p.admitted and now - p.added > self.queue_timeout
                if now - p.last > self.ttl or overdue or p.missing_since is not None:
                    try:
                        await self._check(rid, p)
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:               # Redis away: looked for again next time
                        log.warning("global scheduler: looking for %s: %s", rid, e)

    def _fail(self, rid: str, p: _Pending, why: str) -> None:
        if self.pending.get(rid) is p:
            del self.pending[rid]
            p.callback(EngineDeadError(why))

    async def _run_id(self) -> str | None:
        try:
            return str((await self.r.info("server")).get("run_id")) or None
        except Exception:
            return None

    async def _holder(self, raw: bytes) -> str | None:
        """Where the job ``raw`` is: "" (the queue), an instance id (its
        ``processing`` list), or None (nowhere)."""
        if await self.r.lpos(self.k("queue"), raw) is not None:
            return ""
        start = len(self.k("processing", ""))
        async for key in self.r.scan_iter(match=self.k("processing", "*")):
            key = key.decode() if isinstance(key, bytes) else key
            if await self.r.lpos(key, raw) is not None:
                return key[start:]
        return None

    async def _check(self, rid: str, p: _Pending) -> None:
        """A request with no news for ttl_s (or past its queue timeout): is
        its job queued, held by an instance, or lost?"""
        now = time.monotonic()
        where = await self._holder(p.raw)
        if self.pending.get(rid) is not p:
            return                                       # finished or aborted meanwhile
        if where == "":
            p.missing_since = None
            if not p.admitted and now - p.added > self.queue_timeout:
                if await self.r.lrem(self.k("queue"), 1, p.raw):     # still queued: it leaves the queue
                    self._fail(rid, p, f"the global scheduler did not admit the request in time: it waited "
                                       f"{now - p.added:.0f} s in the queue (queue_timeout_s={self.queue_timeout:g}) "
                                       "while every instance was busy")
                    return
            p.last = now
            return
        if where is not None:
            p.missing_since, p.admitted, p.holder, p.last = None, True, where, now
            if now - p.heard > self.result_timeout:          # a backstop: held, but silent that long
                self._fail(rid, p, f"the global scheduler gave up on the request: the instance holding it ({where}) "
                                   f"sent no result for {now - p.heard:.0f} s (result_timeout_s={self.result_timeout:g})")
            return
        if await self.r.llen(self.k("results", self.id)) > 0:
            return                                       # its last results are waiting to be read
        if p.missing_since is None:
            p.missing_since = now
        if now - p.missing_since < self.grace:
            return
        run_id = await self._run_id()
        last = p.executor or p.holder
        if run_id is not None and p.run_id is not None and run_id != p.run_id:
            why = f"Redis at {redact(self.url)} restarted (its run_id changed) and did not keep the job"
        elif last and last != self.id and not await self.r.exists(self.k("alive", last)):
            why = f"the instance running it ({last}) is gone, and its job was not handed back"
        else:
            why = "its job is in no queue and no instance holds it (was Redis flushed?)"
        self._fail(rid, p, f"the global scheduler lost the request: {why}")

    def _deliver(self, res: Result) -> None:
        p = self.pending.get(res.request_id)
        if p is None or res.attempt < p.attempt:
            return                                   # aborted, finished, or from a dead attempt
        if not p.takes(res):
            self._reject(f"a replayed or out-of-order result for {res.request_id}")
            return
        p.last, p.admitted, p.missing_since = time.monotonic(), True, None
        p.heard = p.last
        if res.fatal is not None or res.error is not None:
            del self.pending[res.request_id]
            p.callback(EngineRejected(res.request_id, res.error) if res.error is not None
                       else EngineDeadError(res.fatal))
            return
        new, lps = [], []
        for i, tok in enumerate(res.token_ids):
            pos = res.offset + i
            if pos < len(p.tokens):
                if p.tokens[pos] != tok:             # a retried attempt that took another path
                    del self.pending[res.request_id]
                    p.callback(EngineDeadError("the instance running the request died, and its retry "
                                               "generated other tokens (unseeded sampling)"))
                    return
                continue
            p.tokens.append(tok)
            new.append(tok)
            if res.logprobs is not None:
                lps.append(res.logprobs[i])
        if not new and res.finish_reason is None:
            return
        if res.finish_reason is not None:
            del self.pending[res.request_id]
        p.callback(SeqDelta(res.request_id, new, res.finish_reason, res.stop_reason,
                            lps if res.logprobs is not None else None, res.num_cached_tokens, res.queue_time_s))

    # -- the executor side --------------------------------------------------------------
    async def _pull(self) -> None:
        queue, mine = self.k("queue"), self.k("processing", self.id)
        while True:
            try:
                await self._check_aborts()
                if len(self.running) >= self.capacity or self.local.dead:
                    await asyncio.sleep(0.02)
                    continue
                raw = await self.r.blmove(queue, mine, 0.2, "LEFT", "RIGHT")
                self.m_queue.set(await self.r.llen(queue))
                if raw is None:
                    continue
                job = unseal(self.key, JOB, raw, _job_dec)
                if job is None:
                    self._reject("a job not sealed with the secret")
                    await self.r.lrem(mine, 1, raw)
                    continue
                if await self.r.exists(self.k("abort", job.request_id)):
                    await self.r.lrem(mine, 1, raw)
                    continue
                attempt = int(await self.r.get(self.k("attempts", job.request_id)) or 0)
                self.running[job.request_id] = _Running(raw, job, attempt)
                self.m_pulls.inc()
                self.local.add(job.request_id, job.prompt_token_ids, job.params,
                               lambda msg, rid=job.request_id: self._on_output(rid, msg), trace=job.trace)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("global scheduler: pulling: %s", e)
                await asyncio.sleep(0.5)

    def _on_output(self, rid: str, msg) -> None:
        run = self.running.get(rid)
        if run is None:
            return
        head = (rid, run.job.origin, self.id, run.seq, run.attempt, run.sent)
        if isinstance(msg, SeqDelta):
            res = Result(*head, list(msg.token_ids), msg.finish_reason, msg.stop_reason, msg.logprobs,
                         msg.num_cached_tokens, msg.queue_time_s)
            run.sent += len(msg.token_ids)
            done = msg.finish_reason is not None
        elif isinstance(msg, EngineRejected):
            res, done = Result(*head, [], error=msg.message), True
        else:                                        # our engine died: the job goes back via the reaper
            return
        run.seq += 1
        self.outbox.put_nowait((run.job.origin, run.raw, res, done))
        if done:
            self.running.pop(rid, None)

    async def _publish(self) -> None:
        while True:
            origin, raw, res, done = await self.outbox.get()
            await self._send(origin, raw, res, done)

    async def _drain_outbox(self) -> None:
        while not self.outbox.empty():
            await self._send(*self.outbox.get_nowait())

    async def _send(self, origin: str, raw: bytes, res: Result, done: bool) -> None:
        deadline = time.monotonic() + self.ttl
        while time.monotonic() < deadline:
            try:
                pipe = self.r.pipeline()
                key = self.k("results", origin)
                pipe.rpush(key, seal(self.key, RESULT, res))
                pipe.expire(key, int(self.ttl) + 1)
                if done:
                    pipe.lrem(self.k("processing", self.id), 1, raw)
                await pipe.execute()
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("global scheduler: publishing: %s", e)
                await asyncio.sleep(0.5)

    async def _check_aborts(self) -> None:
        if not self.running:
            return
        ids = list(self.running)
        flags = await self.r.mget([self.k("abort", rid) for rid in ids])
        for rid, f in zip(ids, flags):
            if f is None:
                continue
            raw = self.running.pop(rid).raw
            self.local.abort([rid])
            await self.r.lrem(self.k("processing", self.id), 1, raw)

    async def _watch(self) -> None:
        """Heartbeat; and put the jobs of instances whose heartbeat stopped
        back in the queue (or fail them after max_attempts)."""
        alive_ttl_ms = int(self.heartbeat * 3000)
        while True:
            try:
                await self.r.set(self.k("alive", self.id), 1, px=alive_ttl_ms)
                run_id = await self._run_id()
                if run_id is not None and self.run_id is not None and run_id != self.run_id:
                    log.warning("global scheduler: Redis at %s restarted (its run_id changed): jobs queued "
                                "before are lost unless it persisted them; putting back the %d this instance "
                                "runs", redact(self.url), len(self.running))
                    mine = self.k("processing", self.id)
                    for run in list(self.running.values()):
                        if await self.r.lpos(mine, run.raw) is None:
                            await self.r.rpush(mine, run.raw)
                if run_id is not None:
                    self.run_id = run_id
                async for key in self.r.scan_iter(match=self.k("processing", "*")):
                    key = key.decode() if isinstance(key, bytes) else key
                    other = key[len(self.k("processing", "")):]
                    if other == self.id or await self.r.exists(self.k("alive", other)):
                        continue
                    while (raw := await self.r.lmove(key, self.k("queue"), "RIGHT", "LEFT")) is not None:
                        await self._requeued(raw, other)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("global scheduler: watching: %s", e)
            await asyncio.sleep(self.heartbeat)

    async def _requeued(self, raw: bytes, dead: str) -> None:
        job = unseal(self.key, JOB, raw, _job_dec)
        if job is None:
            return                                   # not ours: the puller drops it
        attempts = await self.r.incr(self.k("attempts", job.request_id))
        await self.r.expire(self.k("attempts", job.request_id), int(self.ttl) * 4)
        self.m_requeued.inc()
        log.warning("global scheduler: %s held by a dead instance (%s): attempt %d", job.request_id, dead,
                    attempts + 1)
        if attempts >= self.max_attempts:
            await self.r.lrem(self.k("queue"), 1, raw)
            await self._send(job.origin, b"", Result(job.request_id, job.origin, self.id, 0, attempts, 0, [], fatal=(
                f"the global scheduler lost the request: the instance running it ({dead}) is gone (no "
                f"heartbeat within {3 * self.heartbeat:g} s), after {attempts} attempt(s) on instances that died "
                f"(max_attempts={self.max_attempts})")), False)


@hookimpl
def fdx_register_request_schedulers(register):
    register("local", LocalScheduler)
    register("global", GlobalScheduler)
