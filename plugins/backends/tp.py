"""Tensor parallel: the ``tp`` model runner and its worker processes.

    engine process                                worker rank r (of N)
    TensorParallelRunner.execute(step) --WorkerStep--> WorkerRunner.execute(step)
        (the same msgspec bytes to every rank)           its shard of every layer,
                                                          its KV heads; all_reduce
                                                          (paddle.distributed, gloo on
                                                          CPU) after o_proj and down_proj
                  <---- WorkerResult (rank 0 only) ---   rank 0: logits processors and
                                                          sampling; broadcasts the ids

The engine picks this runner when ``parallel.tensor_parallel_size`` is
above 1. Each worker loads the checkpoint itself, keeps its heads and MLP
columns (``DecoderForCausalLM.shard``), allocates its share of the KV
cache (``num_kv_heads / N`` heads of every block) and runs the default
runner's persistent batch over the plain-data steps. Embedding and norms
are whole on every rank; only rank 0 keeps the lm_head (the others a
1-wide stand-in), computes logits and samples (logits processors
included), and ``broadcast`` hands the sampled ids to the others so every
rank's next input is the same.

Steps travel as msgspec over ZMQ (never pickle, never paddle's object
broadcast). A worker that exits or fails makes ``execute`` raise at once
(the rest are killed): the engine fails cleanly, and in ``fdx serve`` the
engine process exits, so the server answers 503 and exits. Workers die
with the process that started them (PR_SET_PDEATHSIG and a parent-pid
check), so none outlives it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import msgspec
import numpy as np
import zmq

from fdx.core.config import ConfigError
from fdx.core.interfaces import ModelRunner, ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("fdx.backends.tp")

READY_TIMEOUT_S = 900.0      # loading a checkpoint in N processes on a busy host is slow
POLL_MS = 50


# -- the wire format --------------------------------------------------------------

class WorkerStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class WorkerStop(msgspec.Struct, tag="stop"):
    pass


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    num_kv_heads: int                  # this rank's


class WorkerResult(msgspec.Struct, tag="result"):
    output: ModelRunnerOutput
    sampled_request_ids: list[str] = []
    logits: bytes | None = None        # float32 [rows, vocab], when decoding.capture_logits
    hidden_states: bytes | None = None  # float32 [rows, hidden], when decoding.capture_hidden_states


class WorkerFailed(msgspec.Struct, tag="failed"):
    rank: int
    message: str


ToWorker = WorkerStep | WorkerStop
FromWorker = WorkerReady | WorkerResult | WorkerFailed
_encoder = msgspec.msgpack.Encoder()


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def check_divisible(model, world: int) -> None:
    """Head counts and the MLP width must split evenly over the ranks."""
    cfg = getattr(model, "cfg", None)
    counts = [("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)]
    if cfg is not None and hasattr(cfg, "intermediate_size"):
        counts.append(("MLP intermediate size", cfg.intermediate_size))
    if not hasattr(model, "shard"):
        raise ConfigError(f"config key 'parallel.tensor_parallel_size': the model "
                          f"{type(model).__name__} cannot be sharded (it has no shard method)")
    for what, count in counts:
        if count % world:
            raise ConfigError(f"config key 'parallel.tensor_parallel_size': {world} does not divide the "
                              f"model's {what} ({count})")


# -- the engine side ------------------------------------------------------------------

class TensorParallelRunner(ModelRunner):
    """Starts ``parallel.tensor_parallel_size`` worker processes, sends each
    step to all of them and returns rank 0's output."""

    def __init__(self, ctx):
        super().__init__(ctx)
        config = ctx.config
        self.world = world = config.parallel.tensor_parallel_size
        check_divisible(ctx.model, world)
        if ctx.connector is not None:
            raise ConfigError("config key 'cache.kv_connector': KV connectors (and the swap tier) do not "
                              "run with parallel.tensor_parallel_size > 1 yet")
        self.taps: dict = {}
        self.failed: str | None = None
        self._dir = tempfile.mkdtemp(prefix="fdx-tp-")
        self._zmq = zmq.Context()
        self._results = self._zmq.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._dir}/results")
        self._steps = []
        ports = _free_ports(world)
        endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
        cores = _available_cores()
        threads = max(1, (config.backend.num_threads or cores) // world)
        payload = json.dumps({"config": config.model_dump(mode="json"), "num_blocks": ctx.kv_spec.num_blocks})
        self.procs: list[subprocess.Popen] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._steps, self._results, self._zmq,
                                           self._dir)
        for rank in range(world):
            sock = self._zmq.socket(zmq.PUSH)
            sock.bind(f"ipc://{self._dir}/steps-{rank}")
            self._steps.append(sock)
            env = {**os.environ, "PADDLE_TRAINER_ID": str(rank), "PADDLE_TRAINERS_NUM": str(world),
                   "PADDLE_TRAINER_ENDPOINTS": endpoints, "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{ports[rank]}",
                   "PADDLE_DISTRI_BACKEND": "gloo", "OMP_NUM_THREADS": str(threads),
                   "GLOG_minloglevel": os.environ.get("GLOG_minloglevel", "2")}
            proc = subprocess.Popen(
                [sys.executable, "-m", "fdx.plugins.backends.tp", "--rank", str(rank), "--world", str(world),
                 "--dir", self._dir, "--threads", str(threads), "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            proc.stdin.write(payload.encode())
            proc.stdin.close()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        ready = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < world:
            msg = self._receive(deadline, "starting")
            if isinstance(msg, WorkerReady):
                ready.add(msg.rank)
        log.info("tensor parallel: %d workers ready (%d threads each)", world, threads)

    def _receive(self, deadline: float | None, doing: str):
        while True:
            if self._results.poll(POLL_MS):
                msg = self._decoder.decode(self._results.recv())
                if isinstance(msg, WorkerFailed):
                    # a peer that died makes the others' collectives fail: name the dead one first
                    dead = self._dead(wait_s=1.0, besides=msg.rank)
                    cause = f"; then rank {msg.rank} failed: {msg.message}"
                    self._fail((dead + cause) if dead else
                               f"tensor parallel worker rank {msg.rank} failed while {doing}: {msg.message}")
                return msg
            dead = self._dead()
            if dead:
                self._fail(f"{dead} while {doing}")
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"tensor parallel workers did not answer in {READY_TIMEOUT_S:.0f} s while {doing}")

    def _dead(self, wait_s: float = 0.0, besides: int | None = None) -> str:
        """'tensor parallel worker rank R exited with code C' for the first
        worker that exited (waiting up to ``wait_s``), or ''."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs):
                if rank != besides and proc.poll() is not None:
                    return f"tensor parallel worker rank {rank} exited with code {proc.returncode}"
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.05)

    def _fail(self, message: str):
        self.failed = message
        self.close()
        raise RuntimeError(message)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.failed is not None:
            raise RuntimeError(self.failed)
        data = _encoder.encode(WorkerStep(so))
        for sock in self._steps:
            sock.send(data)
        while True:
            msg = self._receive(None, f"running step {so.step}")
            if isinstance(msg, WorkerResult):
                break
        self.taps = {}
        if msg.sampled_request_ids:
            rows = len(msg.sampled_request_ids)
            self.taps["sampled_request_ids"] = msg.sampled_request_ids
            if msg.logits is not None:
                self.taps["logits"] = np.frombuffer(msg.logits, np.float32).reshape(rows, -1)
            if msg.hidden_states is not None:
                self.taps["hidden_states"] = np.frombuffer(msg.hidden_states, np.float32).reshape(rows, -1)
        return msg.output

    def last_step_taps(self) -> dict:
        return self.taps

    def close(self) -> None:
        """Stop the workers (idempotent; also at garbage collection and exit)."""
        self._finalizer()


def _stop(procs, steps, results, ctx, path) -> None:
    stop = _encoder.encode(WorkerStop())
    for proc, sock in zip(procs, steps):
        if proc.poll() is None:
            try:
                sock.send(stop, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + 3.0
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for sock in [*steps, results]:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(path, ignore_errors=True)


def _available_cores() -> int:
    from fdx.plugins.backends.cpu import available_cores
    return available_cores()


# -- the worker side ----------------------------------------------------------------------

def _make_worker_runner(base):
    """A default runner whose rank 0 samples and broadcasts the ids; the
    other ranks take them, so every rank's persistent batch stays the same."""
    import paddle
    import paddle.distributed as dist

    class WorkerRunner(base):
        rank = 0

        def _update_states(self, so):
            removed = super()._update_states(so)
            if self.rank != 0:                     # only rank 0 reads logits (its lm_head is whole)
                for nr in so.new_requests:
                    st = self.requests[nr.request_id]
                    if st.params.prompt_logprobs is not None:
                        st.params = dataclasses.replace(st.params, prompt_logprobs=None)
            return removed

        def _sample(self, samplers, raw, removed, out):
            if self.rank == 0:
                super()._sample(samplers, raw, removed, out)
                ids = np.asarray([out.sampled[st.request_id] for st in samplers], dtype=np.int64)
            else:
                ids = np.zeros(len(samplers), dtype=np.int64)
            t = paddle.to_tensor(ids)
            dist.broadcast(t, src=0)
            if self.rank != 0:
                for st, token in zip(samplers, t.numpy().tolist()):
                    st.output_token_ids.append(int(token))

    return WorkerRunner


def build_worker(config, rank: int, world: int, num_blocks: int, threads: int):
    """This rank's model shard, KV cache and runner (in the worker process)."""
    from fdx.core.checkpoint.model import load_model
    from fdx.core.interfaces import KVCacheSpec, RunnerContext
    from fdx.core.plugins import get_plugin_manager
    from fdx.plugins.backends.runner import DefaultModelRunner

    pm = get_plugin_manager()

    def settings(kind, name):
        return dict(config.plugins.get(kind, {}).get(name or "", {}) or {})

    name = config.backend.name
    if name == "auto":
        regs = sorted(pm.registries["backend"].items(), key=lambda kv: -kv[1].obj.priority)
        name = next(n for n, reg in regs if reg.obj.is_available())
    backend = pm.get("backend", name)(settings=settings("backend", name))
    config.backend.num_threads = threads
    backend.setup(config)

    import paddle
    import paddle.distributed as dist
    dist.init_parallel_env()

    def all_reduce(t):
        dist.all_reduce(t)
        return t

    model, ckpt = load_model(config, pm, backend.kernels, progress=False)   # in model.quantization's format
    model.shard(rank, world, all_reduce)
    tokenizer = ckpt.tokenizer
    del ckpt
    if rank != 0:        # the other ranks never read logits: a 1-wide head instead of the vocabulary
        model.drop_lm_head()
    dtype = backend.dtypes[0] if config.model.dtype == "auto" else config.model.dtype
    backend.prepare_model(model, dtype)
    attention = pm.get("attention_backend", backend.attention_backend)(
        settings("attention_backend", backend.attention_backend))
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, num_blocks,
                       config.cache.block_size, backend.kv_cache_dtype(dtype), attention.layout)
    kv_caches = backend.allocate_kv_cache(spec)
    sampler = pm.get("sampler", backend.sampler)(config=config, settings=settings("sampler", backend.sampler))
    builtin = pm.builtin_names("logits_processor")
    names = builtin + [n for n in config.decoding.logits_processors if n not in builtin]
    processors = [pm.get("logits_processor", n)(config, tokenizer, model.vocab_size, settings("logits_processor", n))
                  for n in names] if rank == 0 else []
    eos = frozenset(tokenizer.eos_token_ids)
    runner_cls = _make_worker_runner(DefaultModelRunner)
    runner = runner_cls(RunnerContext(config=config, model=model, kv_caches=kv_caches, kv_spec=spec,
                                      attention=attention, sampler=sampler, logits_processors=processors,
                                      eos_token_ids=eos, settings=settings("model_runner", "default"),
                                      kernels=backend.kernels))
    runner.rank = rank
    return runner, spec


def worker_main(argv: list[str] | None = None) -> int:
    """One rank: ``python -m fdx.plugins.backends.tp --rank R --world N ...``
    (the config arrives over stdin as JSON; PADDLE_* variables name the ranks)."""
    p = argparse.ArgumentParser(prog="fdx-tp-worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    args = p.parse_args(argv)
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C goes to the server; it stops us
    if os.getppid() != args.parent_pid:
        return 1
    logging.basicConfig(level=os.environ.get("FDX_ENGINE_LOG_LEVEL", "WARNING"),
                        format=f"%(levelname)s %(name)s[tp{args.rank}]: %(message)s")
    payload = json.loads(sys.stdin.read())
    ctx = zmq.Context()
    results = ctx.socket(zmq.PUSH)
    results.connect(f"ipc://{args.dir}/results")
    steps = ctx.socket(zmq.PULL)
    steps.connect(f"ipc://{args.dir}/steps-{args.rank}")
    decoder = msgspec.msgpack.Decoder(ToWorker)
    try:
        from fdx.core.config import FdxConfig
        config = FdxConfig.model_validate(payload["config"])
        runner, spec = build_worker(config, args.rank, args.world, payload["num_blocks"], args.threads)
        results.send(_encoder.encode(WorkerReady(args.rank, spec.num_kv_heads)))
        while True:
            while not steps.poll(500):
                if os.getppid() != args.parent_pid:
                    return 1                       # orphaned: the engine is gone
            msg = decoder.decode(steps.recv())
            if isinstance(msg, WorkerStop):
                break
            out = runner.execute(msg.scheduler_output)
            if args.rank == 0:
                taps = runner.last_step_taps()
                logits, hidden = taps.get("logits"), taps.get("hidden_states")
                results.send(_encoder.encode(WorkerResult(
                    out, list(taps.get("sampled_request_ids", [])),
                    None if logits is None else np.ascontiguousarray(logits, np.float32).tobytes(),
                    None if hidden is None else np.ascontiguousarray(hidden, np.float32).tobytes())))
    except Exception as e:
        log.exception("tensor parallel worker rank %d failed", args.rank)
        results.send(_encoder.encode(WorkerFailed(args.rank, f"{type(e).__name__}: {e}")))
        results.close(linger=2000)
        return 1
    results.close(linger=1000)
    steps.close(linger=0)
    return 0


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG: a hung collective cannot outlive us
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(worker_main())
