"""The EngineCore in its own process, and the client the API server drives it with.

    API process                                    engine process
    EngineClient --- EngineAdd / EngineAbort ---->  EngineLoop: drain inbox
                 <-- EngineOutputs (per step) ----             step(), send deltas

Two ZMQ PUSH/PULL pipes over ipc:// sockets; every message is a msgspec
struct encoded as msgpack (never pickle). The engine process sends token
ids only: the API process detokenizes and checks stop strings (see
docs/serving.md). The engine process dies with its parent (PR_SET_PDEATHSIG
on Linux, and a parent-pid check while idle).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

log = logging.getLogger("fdx.engine_proc")


# -- messages --------------------------------------------------------------------

class EngineAdd(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]                   # SamplingParams fields (stop strings stay in the API)


class EngineAbort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class EngineShutdown(msgspec.Struct, tag="shutdown"):
    pass


class SeqDelta(msgspec.Struct, array_like=True):
    request_id: str
    token_ids: list[int]                     # new tokens since the last delta
    finish_reason: str | None = None         # "stop", "length", "abort" once finished
    stop_reason: int | str | None = None     # the stop token id that ended it
    logprobs: list[list[list[float]]] | None = None  # per new token: [[token_id, logprob, rank], ...]
    num_cached_tokens: int = 0
    queue_time_s: float | None = None        # arrival to first scheduled, on the first delta


class EngineStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_blocks: int
    cache_stats: dict[str, float] = {}      # kv_cache.stats(): prefix-cache counters, if any
    num_preempted: int = 0                   # preemptions in this step


class EngineOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[SeqDelta]
    stats: EngineStats


class EngineRejected(msgspec.Struct, tag="rejected"):
    request_id: str
    message: str


class EngineReady(msgspec.Struct, tag="ready"):
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    model_path: str
    backend: str


class EngineFailed(msgspec.Struct, tag="failed"):
    message: str


ToEngine = EngineAdd | EngineAbort | EngineShutdown
FromEngine = EngineOutputs | EngineRejected | EngineReady | EngineFailed

_encoder = msgspec.msgpack.Encoder()


# -- the engine process ------------------------------------------------------------

class EngineLoop:
    """Drain the inbox without blocking while requests run, block on it while
    idle; step; send each changed request's new tokens."""

    IDLE_POLL_MS = 500

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(ToEngine)
        self.num_sent: dict[str, int] = {}       # request id -> tokens already sent
        self.running = True

    def run(self) -> None:
        eng = self.engine
        while self.running:
            busy = eng.has_unfinished()
            touched = self._drain(block=not busy)
            if not self.running:
                break
            if eng.has_unfinished():
                changed = eng.step()
                self._send(changed, eng.last_stats.num_preempted)
            elif touched:
                self._send([], 0)                 # aborts freed blocks: publish the stats

    def _drain(self, block: bool) -> bool:
        touched = False
        if block:
            while not self.inbox.poll(self.IDLE_POLL_MS):
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    self.running = False          # orphaned: the API process is gone
                    return False
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return touched
            touched = True
            self._handle(self.decoder.decode(raw))

    def _handle(self, msg: ToEngine) -> None:
        eng = self.engine
        if isinstance(msg, EngineAdd):
            from fdx.core.sampling_params import SamplingParams
            try:
                params = SamplingParams(**msg.params)
                req = eng.make_request(msg.prompt_token_ids, params, request_id=msg.request_id)
            except (TypeError, ValueError) as e:
                self.outbox.send(_encoder.encode(EngineRejected(msg.request_id, str(e))))
                return
            eng.add_request(req)
            self.num_sent[req.request_id] = 0
        elif isinstance(msg, EngineAbort):
            for rid in msg.request_ids:
                eng.abort_request(rid)
                self.num_sent.pop(rid, None)
        elif isinstance(msg, EngineShutdown):
            self.running = False

    def _send(self, changed: list, num_preempted: int) -> None:
        deltas = []
        for req in changed:
            sent = self.num_sent.get(req.request_id)
            if sent is None:                      # aborted by the API: it knows already
                continue
            new = req.output_token_ids[sent:]
            finished = req.is_finished
            if not new and not finished:
                continue
            lps = None
            if req.logprobs is not None:
                lps = [[[float(t.token_id), t.logprob, float(t.rank)]
                        for t in sorted(d.values(), key=lambda t: t.rank)]
                       for d in req.logprobs[sent:sent + len(new)]]
            queue_time = None
            if sent == 0 and req.first_scheduled_time is not None:
                queue_time = req.first_scheduled_time - req.arrival_time
            deltas.append(SeqDelta(
                req.request_id, list(new),
                finish_reason=req.status.value if finished else None,
                stop_reason=req.stop_reason if finished else None,
                logprobs=lps, num_cached_tokens=req.num_cached_tokens, queue_time_s=queue_time))
            if finished:
                del self.num_sent[req.request_id]
            else:
                self.num_sent[req.request_id] = sent + len(new)
        self.outbox.send(_encoder.encode(EngineOutputs(deltas, self._stats(num_preempted))))

    def _stats(self, num_preempted: int) -> EngineStats:
        eng = self.engine
        kv = eng.kv_cache
        try:
            cache_stats = {k: float(v) for k, v in (kv.stats() or {}).items()}
        except Exception:                         # a plugin's stats must not stop serving
            cache_stats = {}
        return EngineStats(eng.resource_manager.num_running, eng.resource_manager.num_waiting,
                           float(kv.usage), int(kv.num_free_blocks), int(kv.num_blocks),
                           cache_stats, num_preempted)


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGTERM)          # PR_SET_PDEATHSIG
        except OSError:
            pass


def engine_main(argv: list[str] | None = None) -> int:
    """Entry point of the engine process: ``python -m fdx.core.engine_proc``."""
    p = argparse.ArgumentParser(prog="fdx-engine")
    p.add_argument("--inbox", required=True)
    p.add_argument("--outbox", required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    args = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the server; it stops us
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1
    logging.basicConfig(level=os.environ.get("FDX_ENGINE_LOG_LEVEL", "WARNING"),
                        format="%(levelname)s %(name)s: %(message)s")
    config_json = sys.stdin.read()               # the config comes over stdin, as JSON

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(args.outbox)
    try:
        from fdx.core.config import FdxConfig
        from fdx.core.engine import EngineCore
        engine = EngineCore(FdxConfig.model_validate(json.loads(config_json)), progress=False)
        outbox.send(_encoder.encode(EngineReady(
            engine.max_model_len, int(engine.model.vocab_size), int(engine.kv_cache.num_blocks),
            int(engine.config.cache.block_size), str(engine.model_path), engine.backend.describe())))
        EngineLoop(engine, inbox, outbox, args.parent_pid).run()
    except Exception as e:
        if not isinstance(e, (ValueError, FileNotFoundError, KeyError)):   # ConfigError is a ValueError
            log.exception("engine failed")                # a bug: keep the traceback in the log
        outbox.send(_encoder.encode(EngineFailed(f"{type(e).__name__}: {e}")))
        outbox.close(linger=2000)
        return 1
    outbox.close(linger=1000)
    inbox.close(linger=0)
    return 0


# -- the client, in the API process ----------------------------------------------------

class EngineDeadError(RuntimeError):
    """The engine process is gone."""


class EngineClient:
    """Starts the engine process, sends it requests, routes its deltas.

    ``add()`` registers a callback per engine request id; the output task
    calls it with each ``SeqDelta`` (or an ``EngineRejected``), and with an
    ``EngineDeadError`` if the engine dies. ``on_stats`` receives each
    step's ``EngineStats``; ``on_death`` is called once if the process dies
    while not shutting down.
    """

    def __init__(self, config, on_stats: Callable[[EngineStats], None] | None = None,
                 on_death: Callable[[int], None] | None = None):
        self.config = config
        self.on_stats = on_stats
        self.on_death = on_death
        self.ready: EngineReady | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.callbacks: dict[str, Callable[[Any], None]] = {}
        self.dead = False
        self.stopping = False
        self._dir = tempfile.mkdtemp(prefix="fdx-")
        self._ctx = None
        self._tasks: list[asyncio.Task] = []

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> EngineReady:
        import zmq.asyncio
        self._ctx = zmq.asyncio.Context()
        inbox_addr, outbox_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)   # sync: sends never wait
        self._push.setsockopt(zmq.SNDHWM, 0)      # admission control bounds the load, not the pipe
        self._push.bind(inbox_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outbox_addr)
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fdx.core.engine_proc", "--inbox", inbox_addr, "--outbox", outbox_addr,
            "--parent-pid", str(os.getpid()), stdin=asyncio.subprocess.PIPE)
        self.proc.stdin.write(self.config.model_dump_json().encode())
        self.proc.stdin.close()
        first = asyncio.ensure_future(self._pull.recv())
        exited = asyncio.ensure_future(self.proc.wait())
        await asyncio.wait([first, exited], return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            first.cancel()
            raise EngineDeadError(f"the engine process exited with status {self.proc.returncode} "
                                  "while loading (see its messages above)")
        exited.cancel()
        msg = self._decoder.decode(first.result())
        if isinstance(msg, EngineFailed):
            await self.proc.wait()
            raise EngineDeadError(f"the engine failed to start: {msg.message}")
        assert isinstance(msg, EngineReady), msg
        self.ready = msg
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch())]
        return msg

    def add(self, request_id: str, prompt_token_ids: list[int], params: dict[str, Any],
            callback: Callable[[Any], None]) -> None:
        if self.dead or self.stopping:
            raise EngineDeadError("the engine is not running")
        self.callbacks[request_id] = callback
        self._push.send(_encoder.encode(EngineAdd(request_id, prompt_token_ids, params)), zmq.NOBLOCK)

    def abort(self, request_ids: list[str]) -> None:
        live = [rid for rid in request_ids if self.callbacks.pop(rid, None) is not None]
        if live and not self.dead:
            try:
                self._push.send(_encoder.encode(EngineAbort(live)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def finished(self, request_id: str) -> None:
        """Forget a request the engine reported finished."""
        self.callbacks.pop(request_id, None)

    async def _read_outputs(self) -> None:
        while True:
            msg = self._decoder.decode(await self._pull.recv())
            if isinstance(msg, EngineOutputs):
                for delta in msg.outputs:
                    cb = self.callbacks.get(delta.request_id)
                    if cb is not None:
                        if delta.finish_reason is not None:
                            del self.callbacks[delta.request_id]
                        cb(delta)
                if self.on_stats:
                    self.on_stats(msg.stats)
            elif isinstance(msg, EngineRejected):
                cb = self.callbacks.pop(msg.request_id, None)
                if cb is not None:
                    cb(msg)
            elif isinstance(msg, EngineFailed):
                log.error("engine failed: %s", msg.message)

    async def _watch(self) -> None:
        code = await self.proc.wait()
        if self.stopping:
            return
        self.dead = True
        log.error("the engine process died (status %s)", code)
        err = EngineDeadError(f"the engine process died (status {code})")
        callbacks, self.callbacks = self.callbacks, {}
        for cb in callbacks.values():
            cb(err)
        if self.on_death:
            self.on_death(code)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (a shutdown message, then SIGTERM, then SIGKILL)."""
        self.stopping = True
        for t in self._tasks:
            t.cancel()
        proc = self.proc
        if proc is not None and proc.returncode is None:
            try:
                self._push.send(_encoder.encode(EngineShutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            # a loading engine reads no messages: terminate it at once
            actions = (None, proc.terminate, proc.kill) if self.ready else (proc.terminate, proc.kill)
            for action in actions:
                if action is not None:
                    try:
                        action()
                    except ProcessLookupError:
                        break
                try:
                    await asyncio.wait_for(proc.wait(), timeout)
                    break
                except asyncio.TimeoutError:
                    continue
        if self._ctx is not None:
            self._push.close(linger=0)
            self._pull.close(linger=0)
            self._ctx.term()
            self._ctx = None
        shutil.rmtree(self._dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(engine_main())
