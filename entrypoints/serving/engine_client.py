"""The client the API process drives the engine process with.

    API process                                    engine process
    EngineClient --- EngineAdd / EngineAbort ---->  EngineLoop: drain inbox
                 <-- EngineOutputs (per step) ----             step(), send deltas

Two ZMQ PUSH/PULL pipes over ipc:// sockets; every message is a msgspec
struct encoded as msgpack (messages.py, never pickle).
"""
from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from fdx.core.messages import (EngineAbort, EngineAdd, EngineDeadError, EngineFailed, EngineHeartbeat,
                               EngineLoRA, EngineLoRADone, EngineOutputs, EngineReady, EngineRejected,
                               EngineShutdown, EngineStats, FromEngine)
from fdx.core.messages import encoder as _encoder
from fdx.core.procs import death_message, exit_message, spawn_async, stop_async
from fdx.core.sampling_params import SamplingParams

log = logging.getLogger("fdx.engine_client")


# -- the client, in the API process ----------------------------------------------------


START_GRACE_S = 30.0     # the longest a new engine process may take to send its first message


class EngineHungError(EngineDeadError):
    """The engine process sent nothing, not even a heartbeat, for too long."""


class EngineStartError(EngineDeadError):
    """The engine could not load the model or config; the message says why,
    worded as ``fdx generate`` words it."""


class EngineClient:
    """Starts the engine process, sends it requests, routes its deltas.

    ``add()`` registers a callback per engine request id; the output task
    calls it with each ``SeqDelta`` (or an ``EngineRejected``), and with an
    ``EngineDeadError`` if the engine dies. ``on_stats`` receives each
    step's ``EngineStats``; ``on_death`` is called once if the process dies
    while not shutting down.

    Liveness: the engine process sends a heartbeat every
    ``server.engine_heartbeat_interval_s`` from its start (loading and
    kernel builds included); if nothing at all arrives for
    ``server.engine_heartbeat_timeout_s`` the engine is taken as hung (its
    first beat may take up to ``START_GRACE_S``: the child's interpreter
    start, before its heartbeat thread runs, is slow on a busy host): it is
    killed and handled as a death, so requests fail with a message instead
    of waiting forever. A step that runs past ``server.engine_step_timeout_s``
    (each beat says how long the current one has run) is not a hang, but it
    holds every stream: ``long_step_s`` says so until the step ends, and the
    server's /health answers 503 meanwhile.
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
        self._dir: str | None = None             # the ipc sockets' folder, made by start()
        self._ctx = None
        self._tasks: list[asyncio.Task] = []
        sc = config.server
        self.heartbeat_s = sc.engine_heartbeat_interval_s
        self.heartbeat_timeout_s = sc.engine_heartbeat_timeout_s
        self.last_heard = time.monotonic()       # any message from the engine, beats included
        self.last_beat: EngineHeartbeat | None = None
        self.hung = False
        self.step_timeout_s = sc.engine_step_timeout_s
        self.long_step_s: float | None = None    # how long the step now running has run, past the timeout
        self.num_long_steps = 0                  # steps that ran past it, since start
        self.num_rejected = 0                    # messages on our socket that were not engine messages

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self) -> EngineReady:
        import zmq.asyncio
        self._dir = tempfile.mkdtemp(prefix="fdx-")
        self._ctx = zmq.asyncio.Context()
        inbox_addr, outbox_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUSH)   # sync: sends never wait
        self._push.setsockopt(zmq.SNDHWM, 0)      # admission control bounds the load, not the pipe
        self._push.bind(inbox_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(outbox_addr)
        for name in ("in", "out"):
            os.chmod(os.path.join(self._dir, name), 0o600)
        self._decoder = msgspec.msgpack.Decoder(FromEngine)
        self.proc = await spawn_async("fdx.entrypoints.serving.engine_proc", "--inbox", inbox_addr, "--outbox", outbox_addr,
                                      "--heartbeat-s", str(self.heartbeat_s),
                                      payload=self.config.model_dump_json().encode())
        exited = asyncio.ensure_future(self.proc.wait())
        self.last_heard = time.monotonic()
        heard = False                                 # anything from the child yet (its heartbeat thread runs)
        try:
            while True:                               # heartbeats until EngineReady or EngineFailed
                first = asyncio.ensure_future(self._pull.recv())
                await asyncio.wait([first, exited], timeout=self.heartbeat_s,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not first.done():
                    first.cancel()
                    if exited.done():
                        raise EngineDeadError(exit_message("the engine process", self.proc.returncode,
                                                           "while loading"))
                    silent = time.monotonic() - self.last_heard
                    # until its first message the child may still be starting its interpreter (slow on a busy
                    # host): the timeout counts from then, with START_GRACE_S for the start itself
                    limit = self.heartbeat_timeout_s if heard else max(self.heartbeat_timeout_s, START_GRACE_S)
                    if silent > limit:
                        self.proc.kill()
                        await self.proc.wait()
                        raise EngineHungError(f"the engine process stopped responding while loading "
                                              f"(no heartbeat for {silent:.0f} s)")
                    continue
                msg = self._decode(first.result())
                if msg is None:
                    continue
                self.last_heard, heard = time.monotonic(), True
                if isinstance(msg, EngineHeartbeat):
                    self.last_beat = msg
                    continue
                if isinstance(msg, EngineFailed):
                    await self.proc.wait()
                    if msg.expected:
                        raise EngineStartError(msg.message)
                    raise EngineDeadError(f"the engine failed to start: {msg.message}")
                if isinstance(msg, EngineReady):
                    break
        finally:
            if not exited.done():
                exited.cancel()
        self.ready = msg
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch()),
                       asyncio.create_task(self._watchdog())]
        return msg

    def _decode(self, raw: bytes):
        """An engine message, or None (logged) for anything else: the socket
        is owner-only, but a foreign payload must not be unpickled or crash us."""
        try:
            return self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.num_rejected += 1
            if self.num_rejected <= 10:
                log.warning("ignoring a message from the engine socket that is not an fdx engine "
                            "message (%d bytes): %s", len(raw), e)
            return None

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            callback: Callable[[Any], None], trace: dict[str, str] | None = None, lora: str | None = None) -> None:
        """``trace``: the request's X-Request-Id and W3C trace context, for the
        engine's observers (``Request.trace_headers``); ``lora``: its adapter's name."""
        if self.dead or self.stopping:
            raise EngineDeadError("the engine is not running")
        self.callbacks[request_id] = callback
        self._push.send(_encoder.encode(EngineAdd(request_id, prompt_token_ids, params, dict(trace or {}), lora)),
                        zmq.NOBLOCK)

    async def lora(self, name: str, path: str | None) -> EngineRejected | None:
        """Load (``path``) or unload LoRA adapter ``name`` in the engine, between
        its steps: None when done, else the engine's refusal (reason, status)."""
        if self.dead or self.stopping:
            raise EngineDeadError("the engine is not running")
        call_id = f"lora-{secrets.token_hex(8)}"
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.callbacks[call_id] = lambda msg: done.done() or done.set_result(msg)
        self._push.send(_encoder.encode(EngineLoRA(call_id, name, path)), zmq.NOBLOCK)
        try:
            msg = await done
        finally:
            self.callbacks.pop(call_id, None)
        if isinstance(msg, BaseException):        # the engine died meanwhile
            raise msg
        return msg if isinstance(msg, EngineRejected) else None

    def abort(self, request_ids: list[str]) -> None:
        """End requests in the engine (the client went away; EngineAbort)."""
        live = [rid for rid in request_ids if self.callbacks.pop(rid, None) is not None]
        if live and not self.dead:
            try:
                self._push.send(_encoder.encode(EngineAbort(live)),
                                zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def finished(self, request_id: str) -> None:
        """Forget a request the engine reported finished."""
        self.callbacks.pop(request_id, None)

    async def _read_outputs(self) -> None:
        """Read the engine's messages for as long as the client runs. A
        message whose handling fails is logged with its traceback and the
        next one is read: were this task to end, every stream would wait
        forever while the watchdog, seeing messages queued, took the engine
        for alive."""
        while True:
            msg = self._decode(await self._pull.recv())
            if msg is None:
                continue
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 (one bad callback must not stop every stream)
                log.exception("handling the engine's %s failed", type(msg).__name__)

    def _handle(self, msg) -> None:
        self.last_heard = time.monotonic()
        if isinstance(msg, EngineHeartbeat):
            self.last_beat = msg
            self._watch_step(msg.step_s)
        elif isinstance(msg, EngineOutputs):
            self._watch_step(0.0, msg.stats.step_time_s)
            for delta in msg.outputs:
                cb = self.callbacks.get(delta.request_id)
                if cb is not None:
                    if delta.finish_reason is not None:
                        del self.callbacks[delta.request_id]
                    self._call(cb, delta)
            if self.on_stats:
                self.on_stats(msg.stats)
        elif isinstance(msg, EngineRejected):
            cb = self.callbacks.pop(msg.request_id, None)
            if cb is not None:
                cb(msg)
        elif isinstance(msg, EngineLoRADone):
            cb = self.callbacks.pop(msg.call_id, None)
            if cb is not None:
                cb(msg)
        elif isinstance(msg, EngineFailed):
            log.error("engine failed: %s", msg.message)

    @staticmethod
    def _call(cb: Callable[[Any], None], delta) -> None:
        """One request's delta to its callback; a callback that fails is
        logged and the other requests of the step still get theirs."""
        try:
            cb(delta)
        except Exception:  # noqa: BLE001
            log.exception("delivering request %s's output failed", delta.request_id)

    def _watch_step(self, running_s: float, took_s: float = 0.0) -> None:
        """Note a step running past engine_step_timeout_s, once, and its end."""
        if running_s > self.step_timeout_s:
            if self.long_step_s is None:
                self.num_long_steps += 1
                log.warning("an engine step has run for %.1f s (engine_step_timeout_s=%g): every stream waits "
                            "on it; /health answers 503 until it ends", running_s, self.step_timeout_s)
            self.long_step_s = running_s
        elif self.long_step_s is not None:
            log.warning("the long engine step ended after %.1f s", max(took_s, self.long_step_s))
            self.long_step_s = None

    async def _watchdog(self) -> None:
        """Kill the engine when it has been silent past the timeout."""
        period = min(self.heartbeat_s, self.heartbeat_timeout_s / 4)
        while not self.stopping and self.proc.returncode is None:
            t = time.monotonic()
            await asyncio.sleep(period)
            if time.monotonic() - t > period + self.heartbeat_timeout_s / 2:
                continue                              # this process was stalled, not the engine
            if self._pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                continue                              # messages wait to be read: it is alive
            silent = time.monotonic() - self.last_heard
            if silent > self.heartbeat_timeout_s and not self.stopping and self.proc.returncode is None:
                self.hung = True
                log.error("the engine process (pid %s) stopped responding: no heartbeat for %.1f s "
                          "(engine_heartbeat_timeout_s=%g); killing it", self.proc.pid, silent,
                          self.heartbeat_timeout_s)
                try:
                    self.proc.kill()                  # _watch fails the requests in flight
                except ProcessLookupError:
                    pass
                return

    async def _watch(self) -> None:
        code = await self.proc.wait()
        if self.stopping:
            return
        self.dead = True
        if self.hung:
            err: EngineDeadError = EngineHungError(
                f"the engine process stopped responding (no heartbeat for {self.heartbeat_timeout_s:g} s) "
                "and was stopped")
        else:
            err = EngineDeadError(death_message("the engine process", code))
            log.error("%s", err)
        callbacks, self.callbacks = self.callbacks, {}
        for cb in callbacks.values():
            cb(err)
        if self.on_death:
            self.on_death(code)

    def stop(self) -> None:
        """Tell the engine process to stop, without waiting for it (the
        server is stopping and has failed its requests in flight): from now
        on its exit is expected, never a death. Without this message a
        SIGTERM sent to the whole process group would stop the engine on its
        own after EngineLoop.TERM_GRACE_S, while the server may still be
        handing slow clients their last bytes. Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        if self.ready is not None and self.proc.returncode is None:
            try:
                self._push.send(_encoder.encode(EngineShutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine process (a shutdown message, then SIGTERM, then SIGKILL)."""
        self.stop()
        for t in self._tasks:
            t.cancel()
        proc = self.proc
        if proc is not None:
            # stop() sent the shutdown message; a loading engine reads none: terminate it at once
            await stop_async(proc, timeout, asked=self.ready is not None)
        if self._ctx is not None:
            self._push.close(linger=0)
            self._pull.close(linger=0)
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

