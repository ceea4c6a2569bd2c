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
above 1, and starts its executor (``TensorParallelRunner.launch``) before
it sizes the KV cache: the engine process loads no weights (only the
checkpoint's config and tokenizer) and never imports Paddle: each worker
sets the backend up (device, threads, kernel probe) and rank 0 reports
what its setup found (``BackendSetup``), which the engine's backend
adopts (``adopt_setup``). Each worker loads the checkpoint
itself and keeps its heads and MLP columns (``DecoderForCausalLM.shard``);
asked, the workers profile one forward together and report the KV memory
left (``WorkerProfile`` -> ``WorkerBudget``); told the block count
(``WorkerAllocate``), each allocates its share of the KV cache
(``num_kv_heads / N`` heads of every block) and runs the default runner's
persistent batch over the plain-data steps. Guided decoding's bitmask
rides in the step (``SchedulerOutput.guided``), so rank 0 masks as a
single-process runner does. Embedding and norms
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
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ModelRunner, ModelRunnerOutput, SchedulerOutput

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


ToWorker = WorkerStep | WorkerStop | WorkerProfile | WorkerAllocate
FromWorker = WorkerLoaded | WorkerBudget | WorkerReady | WorkerResult | WorkerFailed
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
    """Head counts and the MLP width must split evenly over the ranks
    (``model``: a model, or the engine's ``ModelShape`` of one)."""
    cfg = getattr(model, "cfg", None)
    counts = [("attention heads", model.num_heads), ("KV heads", model.num_kv_heads)]
    if cfg is not None and hasattr(cfg, "intermediate_size"):
        counts.append(("MLP intermediate size", cfg.intermediate_size))
    if not model.shardable():
        raise ConfigError(f"config key 'parallel.tensor_parallel_size': the model "
                          f"{type(model).__name__} cannot be sharded (it has no shard method)")
    for what, count in counts:
        if count % world:
            raise ConfigError(f"config key 'parallel.tensor_parallel_size': {world} does not divide the "
                              f"model's {what} ({count})")


# -- the engine side ------------------------------------------------------------------

class TensorParallelExecutor:
    """The worker processes: started with the model loaded and sharded,
    then asked for a KV budget, told the block count, and fed steps."""

    def __init__(self, config, model):
        self.world = world = config.parallel.tensor_parallel_size
        check_divisible(model, world)
        if config.cache.kv_connector is not None:      # refused before any worker starts
            raise ConfigError("config key 'cache.kv_connector': KV connectors (and the swap tier) do not "
                              "run with parallel.tensor_parallel_size > 1 yet")
        self.num_blocks: int | None = None
        self.failed: str | None = None
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
            proc = subprocess.Popen(
                [sys.executable, "-m", "fdx.plugins.backends.tp", "--rank", str(rank), "--world", str(world),
                 "--dir", self._dir, "--threads", str(threads), "--parent-pid", str(os.getpid())],
                stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            proc.stdin.write(payload.encode())
            proc.stdin.close()
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        loaded = self._gather(WorkerLoaded, "loading the model", time.monotonic() + READY_TIMEOUT_S)
        self.weight_bytes: dict[str, int] = {}      # kind -> bytes, summed over the ranks
        for msg in loaded.values():
            for kind, n in msg.weight_bytes.items():
                self.weight_bytes[kind] = self.weight_bytes.get(kind, 0) + n
        self.setup = loaded[0].setup

    def adopt_setup(self, backend) -> None:
        """Give the engine's ``backend`` (never set up in its process) rank
        0's kernel table and the values its setup chose, so what the engine
        reports (the kernel line, the attention backend) is what the ranks run."""
        from fdx.core.kernels import KernelTable
        if self.setup is None:
            return
        s = self.setup
        for name, value in s.attrs.items():
            setattr(backend, name, value)
        backend.kernels = KernelTable(findings=dict(s.findings), source=s.source, seconds=s.seconds,
                                      location=s.location)

    def _gather(self, kind, doing: str, deadline: float | None) -> dict:
        """One ``kind`` message from every rank: {rank: message}."""
        got = {}
        while len(got) < self.world:
            msg = self._receive(deadline, doing)
            if isinstance(msg, kind):
                got[msg.rank] = msg
        return got

    def profile(self, num_tokens: int, num_seqs: int, memory_fraction: float) -> int:
        """KV bytes: the least any rank has left after one forward of
        ``num_tokens`` tokens in ``num_seqs`` sequences, all ranks at once."""
        self._send(WorkerProfile(num_tokens, num_seqs, memory_fraction))
        budgets = self._gather(WorkerBudget, "profiling", time.monotonic() + READY_TIMEOUT_S)
        return min(b.kv_bytes for b in budgets.values())

    def allocate(self, num_blocks: int) -> None:
        """Each rank allocates its share of ``num_blocks`` KV blocks (once)."""
        if self.num_blocks == num_blocks:
            return
        if self.num_blocks is not None:
            raise ConfigError(f"config key 'cache.num_kv_blocks': the tensor parallel workers hold "
                              f"{self.num_blocks} KV blocks; {num_blocks} needs a new engine")
        self._send(WorkerAllocate(num_blocks))
        self._gather(WorkerReady, "allocating the KV cache", time.monotonic() + READY_TIMEOUT_S)
        self.num_blocks = num_blocks
        log.info("tensor parallel: %d workers ready (%d threads each)", self.world, self.threads)

    def _send(self, msg) -> None:
        if self.failed is not None:
            raise RuntimeError(self.failed)
        data = _encoder.encode(msg)
        for sock in self._steps:
            sock.send(data)

    def execute(self, so: SchedulerOutput) -> WorkerResult:
        self._send(WorkerStep(so))
        while True:
            msg = self._receive(None, f"running step {so.step}")
            if isinstance(msg, WorkerResult):
                return msg

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

    def close(self) -> None:
        """Stop the workers (idempotent; also at garbage collection and exit)."""
        self._finalizer()


class TensorParallelRunner(ModelRunner):
    """Sends each step to every rank of its executor (the engine's, started
    by ``launch`` before KV sizing; or one of its own) and returns rank 0's
    output."""

    @classmethod
    def launch(cls, config, model) -> TensorParallelExecutor:
        """Start the workers (each loads and shards the model) before the
        engine sizes the KV cache: it asks the executor's ``profile``."""
        return TensorParallelExecutor(config, model)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.executor = ctx.executor if ctx.executor is not None else self.launch(ctx.config, ctx.model)
        self.executor.allocate(ctx.kv_spec.num_blocks)
        self.procs = self.executor.procs
        self.taps: dict = {}

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        msg = self.executor.execute(so)
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
        self.executor.close()


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


class Worker:
    """One rank in its process: the model shard (loaded at construction),
    then on request a profile forward and its KV cache and runner."""

    def __init__(self, config, rank: int, world: int, threads: int):
        from fdx.core.assembly import Assembly
        from fdx.core.checkpoint.model import load_model
        from fdx.core.engine import select_backend
        from fdx.core.plugins import get_plugin_manager

        self.config, self.rank = config, rank
        pm = get_plugin_manager()
        config.backend.num_threads = threads
        self.backend = backend = select_backend(config, pm)
        backend.setup(config)
        self.assembly = Assembly(config, pm, backend)       # the engine's, built the same way

        import paddle.distributed as dist
        dist.init_parallel_env()

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        # in model.quantization's format; the tokenizer is built only if a request needs its vocabulary
        model, ckpt = load_model(config, pm, backend.kernels, progress=False, defer_tokenizer=True)
        self.model = model
        model.shard(rank, world, all_reduce)
        self.tokenizer = ckpt.tokenizer
        del ckpt
        if rank != 0:        # the other ranks never read logits: a 1-wide head instead of the vocabulary
            model.drop_lm_head()
        self.dtype = backend.dtypes[0] if config.model.dtype == "auto" else config.model.dtype
        backend.prepare_model(model, self.dtype)
        self.attention = self.assembly.attention()
        self.runner = None

    def spec(self, num_blocks: int):
        from fdx.core.interfaces import KVCacheSpec
        m = self.model
        return KVCacheSpec(m.num_layers, m.num_kv_heads, m.head_dim, num_blocks, self.config.cache.block_size,
                           self.backend.kv_cache_dtype(self.dtype), self.attention.layout)

    def profile(self, msg: WorkerProfile) -> int:
        from fdx.core.memory import kv_budget
        return kv_budget(self.backend, self.model, self.attention, self.spec(0), msg.num_tokens, msg.num_seqs,
                         msg.memory_fraction).kv_bytes

    def allocate(self, num_blocks: int):
        """This rank's KV cache and runner (a default runner whose rank 0
        alone runs the logits processors and samples)."""
        from fdx.plugins.backends.runner import DefaultModelRunner
        spec = self.spec(num_blocks)
        parts = self.assembly.runner_side(
            self.model, self.backend.allocate_kv_cache(spec), spec, self.tokenizer, self.tokenizer.eos_token_ids,
            runner_cls=_make_worker_runner(DefaultModelRunner), attention=self.attention,
            with_processors=self.rank == 0)
        self.runner = parts["runner"]
        self.runner.rank = self.rank
        return spec


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
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C goes to the server; it stops us
    if os.getppid() != args.parent_pid:
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
        from fdx.core.checkpoint.model import held_weight_bytes
        results.send(_encoder.encode(WorkerLoaded(args.rank, held_weight_bytes(worker.model),
                                                  backend_setup(worker.backend) if args.rank == 0 else None)))
        while True:
            while not steps.poll(500):
                if os.getppid() != args.parent_pid:
                    return 1                       # orphaned: the engine is gone
            msg = decoder.decode(steps.recv())
            if isinstance(msg, WorkerStop):
                break
            if isinstance(msg, WorkerProfile):
                results.send(_encoder.encode(WorkerBudget(args.rank, worker.profile(msg))))
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


@hookimpl
def fdx_register_model_runners(register):
    register("tp", TensorParallelRunner)       # the engine's pick when parallel.tensor_parallel_size > 1


if __name__ == "__main__":
    sys.exit(worker_main())
