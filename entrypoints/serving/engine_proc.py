"""The EngineCore in its own process (the client is engine_client.py).

    API process                                    engine process
    EngineClient --- EngineAdd / EngineAbort ---->  EngineLoop: drain inbox
                 <-- EngineOutputs (per step) ----             step(), send deltas

Two ZMQ PUSH/PULL pipes over ipc:// sockets; every message is a msgspec
struct encoded as msgpack (never pickle); ``SamplingParams`` crosses as
itself (a msgspec-encoded dataclass, validated again on decoding). The
engine process sends token ids and finish reasons (its token processor
matches stop strings, so no token past one is computed); the API process
detokenizes (see docs/serving.md). The engine process is a child as
core/procs.py makes them: it dies with its parent (PR_SET_PDEATHSIG on
Linux, and a parent-pid check while idle).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time

import msgspec
import zmq

from fdx.core.messages import (EngineAbort, EngineAdd, EngineFailed, EngineHeartbeat, EngineOutputs,
                               EngineLoRA, EngineLoRADone, EngineReady, EngineRejected, EngineShutdown,
                               EngineStats, SeqDelta, ToEngine)
from fdx.core.messages import encoder as _encoder
from fdx.core.output import DeltaTracker
from fdx.core.procs import orphaned, start_child

log = logging.getLogger("fdx.engine_proc")


# -- the engine process ------------------------------------------------------------

class EngineLoop:
    """Drain the inbox without blocking while requests run, block on it while
    idle; step; send each changed request's new tokens."""

    IDLE_POLL_MS = 500
    TERM_GRACE_S = 3.0      # after a SIGTERM of its own, wait this long for the API's shutdown message
    WAIT_POLL_MS = 2

    def __init__(self, engine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int | None = None):
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(ToEngine)
        self.deltas = DeltaTracker()             # what each request has sent (core/output.py, as LLM's)
        self.last_free = -1                      # free KV blocks in the last stats sent
        self.running = True
        self.last_round = time.monotonic()       # read by the heartbeat thread
        self.step_started: float | None = None   # while a step runs (read by the heartbeat thread)
        self.num_rejected = 0                    # inbox messages that were not engine messages
        self.stop_by: float | None = None        # set by SIGTERM: stop at this monotonic time

    def on_sigterm(self, signum=None, frame=None) -> None:
        """A SIGTERM for the engine itself (systemd stops the whole process
        group; the parent dying sends one too): the API process, stopped at
        the same time, ends its streams and tells us to stop; stop on our own
        only if it does not, or if it is gone. No traceback, no core dump.
        A send already blocked on an API process that reads nothing (its
        queue full) gives up at the deadline too (SNDTIMEO)."""
        if orphaned(self.parent_pid):
            self.running = False
        elif self.stop_by is None:
            self.stop_by = time.monotonic() + self.TERM_GRACE_S
        self.outbox.setsockopt(zmq.SNDTIMEO, int(self.TERM_GRACE_S * 1000))

    def _push(self, data: bytes) -> None:
        """Send to the API process; once stopping (a SIGTERM of our own), wait
        for room only until the deadline, then stop: an API process that
        reads nothing (stopped, starved of CPU) must not hold us past it. A
        fast engine fills the socket's queue (1000 messages) within the grace
        (a Zen 4 ran a tiny model's steps that fast, and the engine waited
        in its send for as long as the API process was stopped)."""
        if self.stop_by is None:
            try:
                self.outbox.send(data)
            except zmq.Again:                     # blocked when the SIGTERM came: its SNDTIMEO ran out
                self.running = False
            return
        left_ms = max(0, int((self.stop_by - time.monotonic()) * 1000))
        try:
            if self.outbox.poll(left_ms, zmq.POLLOUT):
                self.outbox.send(data, zmq.NOBLOCK)
                return
        except zmq.Again:
            pass
        self.running = False

    def run(self) -> None:
        eng = self.engine
        while self.running:
            self.last_round = time.monotonic()
            if self.stop_by is not None and self.last_round >= self.stop_by:
                break
            busy = eng.has_unfinished()
            touched = self._drain(block=not busy)
            if not self.running:
                break
            if eng.has_unfinished():
                self.step_started = time.monotonic()
                try:
                    changed = eng.step()
                finally:
                    self.step_started = None
                if (changed or eng.last_stats.num_scheduled_tokens or touched
                        or eng.kv_cache.num_free_blocks != self.last_free):
                    self._send(changed, eng.last_stats.num_preempted, eng.last_stats)
                else:                             # only waiting on a KV transfer: do not spin
                    self.inbox.poll(self.WAIT_POLL_MS)
            elif touched:
                self._send([], 0)                 # aborts freed blocks: publish the stats

    def _drain(self, block: bool) -> bool:
        touched = False
        if block:
            while not self.inbox.poll(self.IDLE_POLL_MS):
                if orphaned(self.parent_pid):
                    self.running = False          # the API process is gone
                    return False
                if not self.running or (self.stop_by is not None and time.monotonic() >= self.stop_by):
                    return False
        while True:
            try:
                raw = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return touched
            touched = True
            try:
                msg = self.decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # never unpickled, never half-read: a foreign payload is dropped
                self.num_rejected += 1
                if self.num_rejected <= 10:
                    log.warning("engine: ignoring a message that is not an fdx engine message "
                                "(%d bytes): %s", len(raw), e)
                continue
            self._handle(msg)

    def _handle(self, msg: ToEngine) -> None:
        eng = self.engine
        if isinstance(msg, EngineAdd):
            try:
                req = eng.make_request(msg.prompt_token_ids, msg.params, request_id=msg.request_id,
                                       trace_headers=dict(msg.trace) or None, lora_request=msg.lora)
                eng.add_request(req)            # a constrained one starts its compile (or is refused)
            except (TypeError, ValueError) as e:
                log.debug("request %s refused: %s", msg.request_id, e)
                self._push(_encoder.encode(EngineRejected(msg.request_id, str(e), getattr(e, "status", 400))))
                return
            log.debug("request %s added: %d prompt tokens", req.request_id, req.num_prompt_tokens)
            self.deltas.track(req.request_id)
        elif isinstance(msg, EngineAbort):
            for rid in msg.request_ids:
                eng.abort_request(rid)
                self.deltas.forget(rid)
        elif isinstance(msg, EngineLoRA):
            self._push(_encoder.encode(self._lora(msg)))
        elif isinstance(msg, EngineShutdown):
            self.running = False

    def _lora(self, msg: EngineLoRA):
        """Load or unload an adapter between steps: EngineLoRADone, or EngineRejected saying why."""
        from fdx.core.lora import LoRARequest
        eng = self.engine
        try:
            if msg.path is None:
                eng.unload_lora_adapter(msg.name)
            else:
                if eng.lora is not None and msg.name in eng.lora.known:
                    return EngineRejected(msg.call_id, f"the LoRA adapter {msg.name!r} is already loaded")
                eng.load_lora_adapter(LoRARequest(msg.name, eng.lora.next_id() if eng.lora else 1, msg.path))
        except KeyError:
            return EngineRejected(msg.call_id, f"the LoRA adapter {msg.name!r} does not exist", 404)
        except ValueError as e:
            return EngineRejected(msg.call_id, str(e), 400)
        log.info("LoRA adapter %s %s", msg.name, "unloaded" if msg.path is None else f"loaded from {msg.path}")
        return EngineLoRADone(msg.call_id)

    def _send(self, changed: list, num_preempted: int, step=None) -> None:
        deltas = []
        for req in changed:
            if not self.deltas.tracking(req.request_id):     # aborted by the API: it knows already
                continue
            if req.error_status is not None:      # its guided compile failed or timed out
                self.deltas.forget(req.request_id)
                self._push(_encoder.encode(EngineRejected(req.request_id, req.stop_reason, req.error_status)))
                continue
            delta = self.deltas.delta(req)        # no token and not finished: a constraint compiled
            if delta.finish_reason is not None:   # what only crosses the wire: bytes of float32 arrays
                delta.embedding = req.pooled.tobytes() if req.pooled is not None else None
                delta.activations = _captures(req)
            deltas.append(delta)
        self._push(_encoder.encode(EngineOutputs(deltas, self._stats(num_preempted, step))))

    def _stats(self, num_preempted: int, step=None) -> EngineStats:
        eng = self.engine
        kv = eng.kv_cache
        self.last_free = int(kv.num_free_blocks)
        try:
            stats = dict(kv.stats() or {})
            if eng.connector is not None:
                stats.update(eng.connector.stats() or {})
            if eng.guided.enabled:
                stats.update({f"guided_{k}": v for k, v in eng.guided.counts.items()})
            if eng.speculation is not None:         # speculative decoding's counters since start
                c = eng.speculation.counters
                stats.update(spec_decode_num_drafts=c.num_drafts, spec_decode_num_draft_tokens=c.num_draft_tokens,
                             spec_decode_num_accepted_tokens=c.num_accepted_tokens)
            cache_stats = {k: float(v) for k, v in stats.items()}
        except Exception:                         # a plugin's stats must not stop serving
            cache_stats = {}
        return EngineStats(eng.scheduling.num_running, eng.scheduling.num_waiting,
                           float(kv.usage), int(kv.num_free_blocks), int(kv.num_blocks),
                           cache_stats, num_preempted,
                           num_computed_tokens=int(eng.num_computed_tokens),
                           num_recomputed_tokens=int(eng.num_recomputed_tokens),
                           step_time_s=float(step.step_time_s) if step else 0.0,
                           num_prefill_tokens=int(step.num_prefill_tokens) if step else 0,
                           num_decode_tokens=int(step.num_decode_tokens) if step else 0)


def warm_up(engine) -> float:
    """One 2-token greedy request through the engine (a prefill and a decode
    step), so the first client request does not pay for first-call set-up.
    Its blocks are freed after; returns the seconds it took."""
    from fdx.core.sampling_params import SamplingParams
    t0 = time.perf_counter()
    if engine.max_model_len < 4:
        return 0.0
    req = engine.make_request([0, 0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                              request_id="fdx-warmup")
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    secs = time.perf_counter() - t0
    log.debug("warm-up request: %.2f s", secs)
    return secs


def user_message(e: BaseException) -> str:
    """A start-up error as every command prints it (a KeyError's str() quotes it)."""
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


class Heartbeat(threading.Thread):
    """Sends an ``EngineHeartbeat`` every ``interval`` seconds over its own
    socket (ZMQ sockets are not shared between threads). It beats while the
    process loads, builds kernels or runs a long step, and stops only when
    the process is frozen (SIGSTOP, a GIL-holding deadlock) or gone; the
    client treats silence as a hang (engine_client.py). Each beat says how
    long the step now running has run, so a step that holds every stream
    is seen too (engine_step_timeout_s)."""

    def __init__(self, ctx: zmq.Context, outbox_addr: str, interval: float):
        super().__init__(name="fdx-heartbeat", daemon=True)
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 4)     # beats are worthless once stale
        self.sock.connect(outbox_addr)
        self.interval = interval
        self.loop: EngineLoop | None = None      # set once loaded
        self.stop = threading.Event()

    def run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.stop.wait(self.interval):
            loop = self.loop
            now = time.monotonic()
            idle = now - loop.last_round if loop is not None else 0.0
            started = loop.step_started if loop is not None else None
            try:
                with open("/proc/self/statm") as f:
                    rss = int(f.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                rss = 0
            try:
                self.sock.send(_encoder.encode(EngineHeartbeat(loop is None, idle, rss,
                                                               now - started if started else 0.0)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass                              # the API is not reading: nothing to tell it
        self.sock.close(linger=0)


def remove_orphaned_sockets(parent_pid: int | None, *addrs: str) -> None:
    """When the API process that bound these ipc:// sockets is gone (killed
    outright, it could not clean up), remove the socket files and their
    folder (only if nothing else is in it)."""
    if not orphaned(parent_pid):
        return
    paths = [a[len("ipc://"):] for a in addrs if a.startswith("ipc://")]
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)
    for folder in {os.path.dirname(path) for path in paths}:
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def engine_main(argv: list[str] | None = None) -> int:
    """Entry point of the engine process: ``python -m fdx.entrypoints.serving.engine_proc``."""
    p = argparse.ArgumentParser(prog="fdx-engine")
    p.add_argument("--inbox", required=True)
    p.add_argument("--outbox", required=True)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--heartbeat-s", type=float, default=1.0, help="seconds between heartbeats")
    args = p.parse_args(argv)
    if not start_child(args.parent_pid):          # dies with the API process; Ctrl-C is the server's
        remove_orphaned_sockets(args.parent_pid, args.inbox, args.outbox)
        return 1
    from fdx.core.logs import configure
    configure(os.environ.get("FDX_ENGINE_LOG_LEVEL") or os.environ.get("FDX_LOG_LEVEL") or "INFO")
    # Paddle warns at import when OMP_NUM_THREADS > 1; the CPU backend sets the
    # thread count from config (backend.num_threads) or the cores, not from it
    os.environ.pop("OMP_NUM_THREADS", None)
    config_json = sys.stdin.read()               # the config comes over stdin, as JSON

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(args.inbox)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(args.outbox)
    beat = Heartbeat(ctx, args.outbox, args.heartbeat_s)
    beat.start()                                  # loading counts as alive, not as a hang
    try:
        from fdx.core.config import FdxConfig
        from fdx.core.engine import EngineCore
        # the API process tokenizes: the engine builds its tokenizer only if a request needs it
        engine = EngineCore(FdxConfig.model_validate(json.loads(config_json)), progress=False, defer_tokenizer=True)
        kernels = engine.backend.kernel_summary()  # the compiled build and the probed kernel table
        warm_up(engine)
        from fdx.core.host import release_free_heap
        from fdx.core.memory import rss_bytes
        release_free_heap()                       # the warm-up's and the set-up's garbage
        outbox.send(_encoder.encode(EngineReady(
            engine.max_model_len, int(engine.shape.vocab_size), int(engine.kv_cache.num_blocks),
            int(engine.config.cache.block_size), str(engine.model_path), engine.backend.describe(), kernels,
            dict(engine.generation_config), engine.executor.weight_bytes(), rss_bytes(),
            int(getattr(engine.shape.cfg, "hidden_size", 0)))))
        loop = EngineLoop(engine, inbox, outbox, args.parent_pid)
        signal.signal(signal.SIGTERM, loop.on_sigterm)    # in place of Paddle's fatal-error dump
        beat.loop = loop
        try:
            loop.run()
        finally:
            engine.shutdown()        # abort what is left; a KV connector writes its pending saves
    except Exception as e:
        beat.stop.set()
        expected = isinstance(e, (ValueError, FileNotFoundError, KeyError))   # ConfigError is a ValueError
        if not expected:
            log.exception("engine failed")                # a bug: keep the traceback in the log
        message = user_message(e) if expected else f"{type(e).__name__}: {e}"
        outbox.send(_encoder.encode(EngineFailed(message, expected)))
        outbox.close(linger=2000)
        beat.join(5)
        remove_orphaned_sockets(args.parent_pid, args.inbox, args.outbox)
        return 1
    beat.stop.set()
    beat.join(5)
    outbox.close(linger=1000)
    inbox.close(linger=0)
    remove_orphaned_sockets(args.parent_pid, args.inbox, args.outbox)
    return 0


def _captures(req) -> list | None:
    """A finished request's activation captures, as SeqDelta.activations."""
    from fdx.core.activations import collect
    got = collect(req.activations)
    if not got:
        return None
    return [(key, c.positions, int(c.values.shape[1]), c.values.tobytes()) for key, c in got.items()]


if __name__ == "__main__":
    sys.exit(engine_main())

