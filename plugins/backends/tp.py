"""Tensor parallel: the ``tp`` executor and its worker processes.

    engine process                                  worker rank r (of N)
    TensorParallelExecutor.execute(step) --WorkerStep--> the config's runner (the same
        (the same msgspec bytes to every rank)             class on every rank): its shard
                                                            of every layer, its KV heads;
                                                            all_reduce (paddle.distributed,
                                                            gloo on CPU) after o_proj and
                                                            down_proj
                  <---- WorkerResult (rank 0 only) -----   rank 0: logits processors, guided
                                                            bitmask, sampling; shares the ids

The engine builds this executor (``parallel.runner``, registered with the
model runners) when ``parallel.tensor_parallel_size`` is above 1; it is the
engine's only way to the model (contract: ``fdx.core.interfaces.Executor``).
The engine process loads no weights (only the checkpoint's config and
tokenizer) and never imports Paddle: each worker sets the backend up
(device, threads, kernel probe) and rank 0 reports what its setup found
(``BackendSetup``), which the engine's backend adopts. Each worker loads
the checkpoint itself and keeps its heads and MLP columns
(``Model.shard``); asked, the workers profile one forward together and
report the KV memory left (``WorkerProfile`` -> ``WorkerBudget``); told the
block count (``WorkerAllocate``), each allocates its share of the KV cache
(``num_kv_heads / N`` heads of every block) and builds the runner the
config names (``backend.model_runner`` or the backend's), as the
in-process executor does, with ``rank``, ``world_size`` and
``share_sampled`` in its RunnerContext (``ModelRunner``'s rank contract:
rank 0 samples, a ``broadcast`` hands the ids to the others). Guided
decoding's bitmask rides in the step (``SchedulerOutput.guided``), so rank
0 masks as a single-process runner does. Embedding and norms are whole on
every rank; only rank 0 keeps the lm_head (the others a 1-wide stand-in).
``WorkerReconfigure`` rebuilds each rank's runner side for a new config.
With ``parallel.expert_parallel_size`` a MoE model's ranks hold whole
experts instead (fdx.plugins.backends.expert_parallel: the load, the shard
and the checks); rank 0 sends each step's expert load back with its result.

What does not run here yet is refused before any worker starts, a
ConfigError naming the key: a KV connector (``cache.kv_connector``, the
swap tier), ``model.task: embed``, a model class without ``shard`` or
``parse_config`` (``parallel.tensor_parallel_size``), head counts or MLP
width the ranks do not divide, a runner without the rank contract
(``backend.model_runner``, checked by the assembly).

Steps travel as msgspec over ZMQ (never pickle, never paddle's object
broadcast). A worker that exits or fails makes ``execute`` raise at once
(the rest are killed): the engine fails cleanly, and in ``fdx serve`` the
engine process exits, so the server answers 503 and exits. Workers die
with the process that started them (PR_SET_PDEATHSIG and a parent-pid
check), so none outlives it.
"""
from __future__ import annotations

import argparse
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
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Executor, Model, ModelRunnerOutput, ModelShape, SchedulerOutput
from fdx.core.procs import exit_message, orphaned, spawn, start_child, stop

log = logging.getLogger("fdx.backends.tp")

READY_TIMEOUT_S = 900.0      # loading a checkpoint in N processes on a busy host is slow
POLL_MS = 50


# -- the wire format --------------------------------------------------------------

class WorkerStep(msgspec.Struct, tag="step"):
    scheduler_output: SchedulerOutput


class WorkerStop(msgspec.Struct, tag="stop"):
    pass


class WorkerProfile(msgspec.Struct, tag="profile"):
    num_tokens: int                    # one forward of this many tokens ...
    num_seqs: int                      # ... in this many sequences
    memory_fraction: float


class WorkerAllocate(msgspec.Struct, tag="allocate"):
    num_blocks: int


class WorkerReconfigure(msgspec.Struct, tag="reconfigure"):
    config: str                        # the new config, as JSON (FdxConfig.model_dump)


class WorkerLoRA(msgspec.Struct, tag="lora"):
    name: str
    path: str | None                   # None: unload ``name``


class WorkerLoRADone(msgspec.Struct, tag="lora_done"):
    rank: int
    error: str | None = None           # why this rank refused the adapter (a ValueError's message)


class BackendSetup(msgspec.Struct):
    """A rank's backend after its ``setup``, for the engine process, which
    sets none up (it never loads Paddle): the probed kernel table and the
    plain values setup chose (attention backend, threads, build status)."""
    findings: dict[str, str | None]
    source: str
    seconds: float
    location: str
    attrs: dict[str, str | int | float | bool | None] = {}


class WorkerLoaded(msgspec.Struct, tag="loaded"):
    rank: int
    weight_bytes: dict[str, int] = {}   # kind -> bytes of this rank's shard (the model's weight_bytes())
    setup: BackendSetup | None = None   # rank 0's


class WorkerBudget(msgspec.Struct, tag="budget"):
    rank: int
    kv_bytes: int                      # memory_fraction of what this rank's profile forward left
    free_bytes: int = 0                # this rank's core.memory.KVBudget figures
    peak_bytes: int = 0
    num_tokens: int = 0
    num_seqs: int = 0


class WorkerReady(msgspec.Struct, tag="ready"):
    rank: int
    num_kv_heads: int                  # this rank's
    error: str | None = None           # a reconfigure this rank refused (a ConfigError's message)


class WorkerResult(msgspec.Struct, tag="result"):
    output: ModelRunnerOutput
    sampled_request_ids: list[str] = []
    logits: bytes | None = None        # float32 [rows, vocab], when decoding.capture_logits
    hidden_states: bytes | None = None  # float32 [rows, hidden], when decoding.capture_hidden_states
    expert_load: list[list[int]] | None = None   # a MoE model: the step's tokens per expert per MoE layer


class WorkerFailed(msgspec.Struct, tag="failed"):
    rank: int
    message: str


ToWorker = WorkerStep | WorkerStop | WorkerProfile | WorkerAllocate | WorkerReconfigure | WorkerLoRA
FromWorker = WorkerLoaded | WorkerBudget | WorkerReady | WorkerResult | WorkerFailed | WorkerLoRADone
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


def check_divisible(shape: ModelShape, world: int) -> None:
    """Head counts and the MLP width must split evenly over the ranks."""
    counts = [("attention heads", shape.num_heads), ("KV heads", shape.num_kv_heads)]
    if shape.cfg is not None and hasattr(shape.cfg, "intermediate_size"):
        counts.append(("MLP intermediate size", shape.cfg.intermediate_size))
    for what, count in counts:
        if count % world:
            raise ConfigError(f"config key 'parallel.tensor_parallel_size': {world} does not divide the "
                              f"model's {what} ({count})")


def sharded_shape(config, plugins, ckpt) -> ModelShape:
    """The shape of the checkpoint's model class, read from its config
    alone; a ConfigError naming the key when the class, the task or the
    head counts cannot run at ``parallel.tensor_parallel_size``."""
    from fdx.model_io.model import model_class
    world = config.parallel.tensor_parallel_size
    key = "config key 'parallel.tensor_parallel_size'"
    arch, cls = model_class(ckpt, plugins, config)
    if not cls.shardable():
        raise ConfigError(f"{key}: the model {cls.__name__} ({arch}) cannot be sharded over {world} ranks "
                          "(it does not override Model.shard)")
    if cls.parse_config.__func__ is Model.parse_config.__func__:
        raise ConfigError(f"{key}: the model {cls.__name__} ({arch}) cannot run over {world} ranks: the engine "
                          "process reads its shape from Model.parse_config, which it does not override")
    c = cls.parse_config(ckpt.config)
    shape = ModelShape.of(c, cfg=c, hooks=cls.supports_activation_hooks)
    check_divisible(shape, world)
    from fdx.plugins.backends import expert_parallel
    expert_parallel.check(config, cls, arch, ckpt.config)     # parallel.expert_parallel_size (a MoE model's counts)
    return shape


# -- the engine side ------------------------------------------------------------------

class TensorParallelExecutor(Executor):
    """Ranks 0 .. N-1 in worker processes: started with the model loaded
    and sharded, then asked for a KV budget, told the block count, and fed
    steps; rank 0's output comes back whole."""

    def __init__(self, settings, context):
        from fdx.model_io.loader import load_metadata
        from fdx.model_io.model import weight_format
        assembly, backend, defer_tokenizer = context.assembly, context.backend, context.defer_tokenizer
        config = assembly.config
        self.world = world = config.parallel.tensor_parallel_size
        self.backend = backend
        if config.cache.kv_connector is not None:      # refused before any worker starts
            raise ConfigError("config key 'cache.kv_connector': KV connectors (and the swap tier) do not "
                              f"run with parallel.tensor_parallel_size={world} yet")
        if config.model.task == "embed":
            raise ConfigError(f"config key 'model.task': embed does not run with parallel.tensor_parallel_size="
                              f"{world} yet (the ranks pool no hidden states); set tensor_parallel_size=1")
        assembly.set_backend(backend)      # the runner's rank contract, before any worker starts
        weight_format(config, assembly.plugins, backend.kernels)   # a bad model.quantization, likewise
        self.checkpoint = load_metadata(config.model.model, defer_tokenizer=defer_tokenizer)
        self.shape = sharded_shape(config, assembly.plugins, self.checkpoint)
        self.num_blocks: int | None = None
        self.failed: str | None = None
        self.taps: dict = {}
        self.expert_load: list[list[int]] | None = None     # rank 0's, from the last step
        self._dir = tempfile.mkdtemp(prefix="fdx-tp-")
        self._zmq = zmq.Context()
        self._results = self._zmq.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._dir}/results")
        self._steps = []
        ports = _free_ports(world)
        endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
        cores = _available_cores()
        self.threads = threads = max(1, (config.backend.num_threads or cores) // world)
        payload = json.dumps({"config": config.model_dump(mode="json")})
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
            self.procs.append(spawn("fdx.plugins.backends.tp", "--rank", str(rank), "--world", str(world),
                                    "--dir", self._dir, "--threads", str(threads), payload=payload.encode(),
                                    env=env))
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        loaded = self._gather(WorkerLoaded, "loading the model", time.monotonic() + READY_TIMEOUT_S)
        self.held: dict[str, int] = {}      # kind -> bytes, summed over the ranks
        for msg in loaded.values():
            for kind, n in msg.weight_bytes.items():
                self.held[kind] = self.held.get(kind, 0) + n
        self._adopt_setup(loaded[0].setup)
        assembly.set_backend(backend)      # rank 0's attention choice

    def _adopt_setup(self, setup: BackendSetup | None) -> None:
        """Give the engine's backend (never set up in its process) rank 0's
        kernel table and the values its setup chose, so what the engine
        reports (the kernel line, the attention backend) is what the ranks run."""
        from fdx.core.kernels import KernelTable
        if setup is None:
            return
        for name, value in setup.attrs.items():
            setattr(self.backend, name, value)
        self.backend.kernels = KernelTable(findings=dict(setup.findings), source=setup.source,
                                           seconds=setup.seconds, location=setup.location)

    def _gather(self, kind, doing: str, deadline: float | None) -> dict:
        """One ``kind`` message from every rank: {rank: message}."""
        got = {}
        while len(got) < self.world:
            msg = self._receive(deadline, doing)
            if isinstance(msg, kind):
                got[msg.rank] = msg
        return got

    def kv_budget(self, num_tokens: int, num_seqs: int, memory_fraction: float) -> int:
        """The least KV bytes any rank has left after one forward of
        ``num_tokens`` tokens in ``num_seqs`` sequences, all ranks at once."""
        from fdx.core.memory import KVBudget
        self._send(WorkerProfile(num_tokens, num_seqs, memory_fraction))
        budgets = self._gather(WorkerBudget, "profiling", time.monotonic() + READY_TIMEOUT_S)
        b = min(budgets.values(), key=lambda b: b.kv_bytes)
        self.budget = KVBudget(b.free_bytes, b.peak_bytes, b.kv_bytes, b.num_tokens, b.num_seqs)
        return b.kv_bytes

    def allocate(self, kv_spec, connector=None) -> None:
        """Each rank allocates its share of ``kv_spec.num_blocks`` KV blocks
        and builds its runner (once)."""
        if connector is not None:
            raise ConfigError("config key 'cache.kv_connector': KV connectors do not run with "
                              f"parallel.tensor_parallel_size={self.world} yet")
        if self.num_blocks is not None:
            raise RuntimeError("the KV cache is allocated once")
        self._send(WorkerAllocate(kv_spec.num_blocks))
        self._gather(WorkerReady, "allocating the KV cache", time.monotonic() + READY_TIMEOUT_S)
        self.num_blocks = kv_spec.num_blocks
        log.info("tensor parallel: %d workers ready (%d threads each)", self.world, self.threads)

    def reconfigure(self, assembly, connector=None) -> None:
        """Each rank rebuilds its runner side for ``assembly.config``; a
        rank's ConfigError comes back as one here."""
        if connector is not None:
            raise ConfigError("config key 'cache.kv_connector': KV connectors do not run with "
                              f"parallel.tensor_parallel_size={self.world} yet")
        self._send(WorkerReconfigure(json.dumps(assembly.config.model_dump(mode="json"))))
        ready = self._gather(WorkerReady, "reconfiguring", time.monotonic() + READY_TIMEOUT_S)
        errors = [m.error for _, m in sorted(ready.items()) if m.error]
        if errors:
            raise ConfigError(errors[0])

    def _send(self, msg) -> None:
        if self.failed is not None:
            raise RuntimeError(self.failed)
        data = _encoder.encode(msg)
        for sock in self._steps:
            sock.send(data)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._send(WorkerStep(so))
        while True:
            msg = self._receive(None, f"running step {so.step}")
            if isinstance(msg, WorkerResult):
                break
        self.taps = {}
        self.expert_load = msg.expert_load
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

    def last_expert_load(self) -> list[list[int]] | None:
        """A MoE model's tokens per expert per MoE layer in the last step (rank 0's
        count: every rank routes every row), as the in-process model's
        ``last_expert_load()``; None for another model (plugins/models/moe_taps.py)."""
        return self.expert_load

    def load_lora(self, name: str, path: str) -> None:
        """Every rank reads the adapter and keeps its shard; when one refuses
        it, every rank drops it and the first reason is raised."""
        errors = self._lora(WorkerLoRA(name, path))
        if errors:
            self._lora(WorkerLoRA(name, None))
            raise ValueError(errors[0])

    def unload_lora(self, name: str) -> None:
        self._lora(WorkerLoRA(name, None))

    def _lora(self, msg: WorkerLoRA) -> list[str]:
        self._send(msg)
        done = self._gather(WorkerLoRADone, "loading a LoRA adapter", time.monotonic() + READY_TIMEOUT_S)
        return [m.error for _, m in sorted(done.items()) if m.error]

    def weight_bytes(self) -> dict[str, int]:
        return dict(self.held)

    def _receive(self, deadline: float | None, doing: str):
        while True:
            if self._results.poll(POLL_MS):
                msg = self._decoder.decode(self._results.recv())
                if isinstance(msg, WorkerFailed):
                    # a peer that died makes the others' collectives fail: name the dead one first
                    dead = self._dead(f"while {doing}", wait_s=1.0, besides=msg.rank)
                    cause = f"; then rank {msg.rank} failed: {msg.message}"
                    self._fail((dead + cause) if dead else
                               f"tensor parallel worker rank {msg.rank} failed while {doing}: {msg.message}")
                return msg
            dead = self._dead(f"while {doing}")
            if dead:
                self._fail(dead)
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"tensor parallel workers did not answer in {READY_TIMEOUT_S:.0f} s while {doing}")

    def _dead(self, when: str, wait_s: float = 0.0, besides: int | None = None) -> str:
        """How the first worker that exited ended ('tensor parallel worker
        rank R exited with status C <when>', or the signal that killed it;
        core/procs.py), waiting up to ``wait_s``; '' when none did."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs):
                if rank != besides and proc.poll() is not None:
                    return exit_message(f"tensor parallel worker rank {rank}", proc.returncode, when)
            if time.monotonic() >= deadline:
                return ""
            time.sleep(0.05)

    def _fail(self, message: str):
        self.failed = message
        self.close()
        raise RuntimeError(message)

    def close(self) -> None:
        """Stop the workers (idempotent; also at garbage collection and exit)."""
        self._finalizer()


def _stop(procs, steps, results, ctx, path) -> None:
    message = _encoder.encode(WorkerStop())
    for proc, sock in zip(procs, steps):
        if proc.poll() is None:
            try:
                sock.send(message, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    stop(procs, grace_s=3.0)
    for sock in [*steps, results]:
        sock.close(linger=0)
    ctx.term()
    shutil.rmtree(path, ignore_errors=True)


def _available_cores() -> int:
    from fdx.plugins.backends.cpu import available_cores
    return available_cores()


# -- the worker side ----------------------------------------------------------------------

class Worker:
    """One rank in its process: the model shard (loaded at construction),
    then on request a profile forward, its KV cache and the config's runner."""

    def __init__(self, config, rank: int, world: int, threads: int):
        from fdx.core.assembly import Assembly
        from fdx.core.engine import select_backend
        from fdx.core.plugins import get_plugin_manager

        self.config, self.rank, self.world = config, rank, world
        self.plugins = pm = get_plugin_manager()
        config.backend.num_threads = threads
        self.backend = backend = select_backend(config, pm)
        backend.setup(config)
        self.assembly = Assembly(config, pm, backend)       # the engine's, built the same way

        import paddle
        import paddle.distributed as dist
        dist.init_parallel_env()

        if config.backend.batch_invariant:
            # gloo's ring all-reduce sums an element in an order set by where it falls in the
            # buffer's chunks, so by the step's row count: a row's bits would depend on the
            # batch. Gathered and summed in rank order instead, the same on every rank.
            def all_reduce(t):
                parts: list = []
                dist.all_gather(parts, t)
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                paddle.assign(total, output=t)
                return t
        else:
            def all_reduce(t):
                dist.all_reduce(t)
                return t

        def share_sampled(ids: np.ndarray) -> np.ndarray:
            t = paddle.to_tensor(ids)
            dist.broadcast(t, src=0)
            return t.numpy()

        self.share_sampled = share_sampled
        # in model.quantization's format, this rank's shard (and, with expert parallel, its experts only);
        # the tokenizer is built only if a request needs its vocabulary
        from fdx.plugins.backends.expert_parallel import load_rank_model
        model, ckpt = load_rank_model(config, pm, backend.kernels, rank, world, all_reduce)
        self.model = model
        self.tokenizer = ckpt.tokenizer
        del ckpt
        if rank != 0:        # the other ranks never read logits: a 1-wide head instead of the vocabulary
            model.drop_lm_head()
        self.dtype = backend.dtypes[0] if config.model.dtype == "auto" else config.model.dtype
        backend.prepare_model(model, self.dtype)
        self.attention = self.assembly.attention()
        self.runner = None
        self.kv_caches: list = []

    def spec(self, num_blocks: int):
        from fdx.core.interfaces import KVCacheSpec
        m = self.model
        return KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks, self.config.cache.block_size,
                           self.backend.kv_cache_dtype(self.dtype), self.attention.layout)

    def profile(self, msg: WorkerProfile) -> WorkerBudget:
        from fdx.core.memory import kv_budget
        b = kv_budget(self.backend, self.model, self.attention, self.spec(0), msg.num_tokens, msg.num_seqs,
                      msg.memory_fraction)
        return WorkerBudget(self.rank, b.kv_bytes, b.free_bytes, b.peak_bytes, b.num_tokens, b.num_seqs)

    def allocate(self, num_blocks: int):
        """This rank's KV cache and runner."""
        self.kv_spec = spec = self.spec(num_blocks)
        self.kv_caches = self.backend.allocate_kv_cache(spec)
        self._build(self.assembly)
        return spec

    def lora(self, msg: WorkerLoRA) -> str | None:
        """Load (or, with no path, drop) a LoRA adapter: this rank's shard. A
        refused adapter's reason, or None."""
        if msg.path is None:
            if self.model.supports_lora:
                self.model.unload_lora(msg.name)
            return None
        from fdx.core.lora import make_loader, read_adapter
        try:
            adapter = read_adapter(make_loader(self.config, self.plugins), msg.path, self.model,
                                   self.config.lora.max_lora_rank)
            self.model.load_lora(msg.name, adapter)
        except ValueError as e:
            return str(e)
        return None

    def reconfigure(self, config) -> None:
        from fdx.core.assembly import Assembly
        config.backend.num_threads = self.config.backend.num_threads
        self._build(Assembly(config, self.plugins, self.backend))

    def _build(self, assembly) -> None:
        parts = assembly.runner_side(self.model, self.kv_caches, self.kv_spec, self.tokenizer,
                                     self.tokenizer.eos_token_ids, attention=self.attention, rank=self.rank,
                                     world_size=self.world, share_sampled=self.share_sampled)
        self.runner = parts["runner"]


def backend_setup(backend) -> BackendSetup:
    """What ``backend.setup`` found and chose here: its kernel table and the
    plain values among its instance attributes (its settings aside)."""
    t = backend.kernels
    attrs = {k: v for k, v in vars(backend).items()
             if k not in ("settings", "kernels") and (v is None or isinstance(v, (str, int, float, bool)))}
    return BackendSetup(dict(t.findings), t.source, t.seconds, t.location, attrs)


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
    # SIGKILL when the engine dies: a rank blocked in a collective would never run a handler
    if not start_child(args.parent_pid, signal.SIGKILL):
        return 1
    from fdx.core.logs import configure
    configure(os.environ.get("FDX_ENGINE_LOG_LEVEL", "WARNING"), tag=f"[tp{args.rank}]")
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
        worker = Worker(config, args.rank, args.world, args.threads)
        from fdx.model_io.model import held_weight_bytes
        from fdx.plugins.backends.expert_parallel import expert_load
        results.send(_encoder.encode(WorkerLoaded(args.rank, held_weight_bytes(worker.model),
                                                  backend_setup(worker.backend) if args.rank == 0 else None)))
        while True:
            while not steps.poll(500):
                if orphaned(args.parent_pid):
                    return 1                       # the engine is gone
            msg = decoder.decode(steps.recv())
            if isinstance(msg, WorkerStop):
                break
            if isinstance(msg, WorkerProfile):
                results.send(_encoder.encode(worker.profile(msg)))
                continue
            if isinstance(msg, WorkerReconfigure):
                try:
                    worker.reconfigure(FdxConfig.model_validate(json.loads(msg.config)))
                    error = None
                except ConfigError as e:       # this rank keeps its runner; the engine raises it
                    error = str(e)
                results.send(_encoder.encode(WorkerReady(args.rank, worker.kv_spec.num_kv_heads, error)))
                continue
            if isinstance(msg, WorkerLoRA):
                results.send(_encoder.encode(WorkerLoRADone(args.rank, worker.lora(msg))))
                continue
            if isinstance(msg, WorkerAllocate):
                spec = worker.allocate(msg.num_blocks)
                results.send(_encoder.encode(WorkerReady(args.rank, spec.num_kv_heads)))
                continue
            runner = worker.runner
            out = runner.execute(msg.scheduler_output)
            if args.rank == 0:
                taps = runner.last_step_taps()
                logits, hidden = taps.get("logits"), taps.get("hidden_states")
                results.send(_encoder.encode(WorkerResult(
                    out, list(taps.get("sampled_request_ids", [])),
                    None if logits is None else np.ascontiguousarray(logits, np.float32).tobytes(),
                    None if hidden is None else np.ascontiguousarray(hidden, np.float32).tobytes(),
                    expert_load(worker.model))))
    except Exception as e:
        log.exception("tensor parallel worker rank %d failed", args.rank)
        results.send(_encoder.encode(WorkerFailed(args.rank, f"{type(e).__name__}: {e}")))
        results.close(linger=2000)
        return 1
    results.close(linger=1000)
    steps.close(linger=0)
    return 0


@hookimpl
def fdx_register_model_runners(register):
    register("tp", TensorParallelExecutor)     # an executor: parallel.runner's pick above TP 1


if __name__ == "__main__":
    sys.exit(worker_main())
