"""Record a run's step decisions, replay its arrivals under another
scheduling configuration, and compare the two (docs/research.md).

Time here is engine steps, not seconds: an ``Arrival`` is added just before
step ``step`` of the run (0: before the first), and every figure (latency,
time to first token, tokens per step) counts steps, so a comparison does
not depend on how loaded the machine is.

    trace = record(engine, arrivals)                  # under the engine's current parts
    other = replay(engine, trace, policy="priority")  # reconfigure, then the same arrivals
    compare(trace, other)

``replay`` means: the same requests (prompts, sampling parameters and seeds,
names), added at the same step numbers, on the same engine (same model and
KV tensors) after ``engine.reconfigure(**changes)``, from fresh scheduling
parts as every recording starts; only the scheduling differs. Each step's decision (which requests ran, with how many tokens,
and which were preempted) is recorded as the scheduler made it.

``replay(engine, trace, exact=True)`` re-makes the recorded decisions
instead: a ``RecordedPolicy`` in place of the engine's KV scheduler
hands the scheduling core each step's recorded batch (preempting the
recorded victims when blocks run out, as v1 does), so the run is the
recording step for step and greedy tokens equal it. A recording that does
not fit the engine (another block count or size, a step its blocks cannot
hold) is refused with an error naming what differs.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from fdx.core.interfaces import KVScheduler
from fdx.core.sampling_params import SamplingParams


@dataclass(slots=True)
class Arrival:
    step: int                          # added just before this step of the run (0: before the first)
    prompt_token_ids: list[int]
    params: SamplingParams
    name: str = ""                     # its request id in the trace; "" -> "a<index>"
    priority: int = 0                  # for the priority queue policy (lower first)


@dataclass(slots=True)
class StepDecision:
    step: int                          # the run's step number, from 0
    scheduled: dict[str, int]          # request name -> tokens computed this step, in batch order
    preempted: list[str]               # preempted in this step
    num_running: int                   # after the step
    num_waiting: int

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


@dataclass(slots=True)
class RequestTrace:
    name: str
    arrival_step: int
    first_scheduled_step: int | None = None
    first_token_step: int | None = None   # the step that sampled its first output token
    finished_step: int | None = None
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def latency_steps(self) -> int | None:
        """Steps from arrival to the end, both counted (one step: 1)."""
        return None if self.finished_step is None else self.finished_step - self.arrival_step + 1

    @property
    def ttft_steps(self) -> int | None:
        """Steps from arrival to the first token, both counted."""
        return None if self.first_token_step is None else self.first_token_step - self.arrival_step + 1


@dataclass(slots=True)
class Trace:
    label: str                         # what ran (scheduler, queue policy, victim policy, cache)
    arrivals: list[Arrival]
    steps: list[StepDecision]
    requests: dict[str, RequestTrace]  # by name, in arrival order
    kv: dict[str, int] = field(default_factory=dict)   # the engine's KV blocks: num_blocks, block_size

    def summary(self) -> dict:
        """Steps, tokens per step (all computed tokens over all steps of the
        run), mean and max latency and time to first token in steps,
        preemptions."""
        lat = [r.latency_steps for r in self.requests.values() if r.latency_steps is not None]
        ttft = [r.ttft_steps for r in self.requests.values() if r.ttft_steps is not None]
        tokens = sum(s.num_tokens for s in self.steps)
        return dict(steps=len(self.steps), tokens=tokens,
                    tokens_per_step=tokens / len(self.steps) if self.steps else 0.0,
                    mean_latency_steps=sum(lat) / len(lat) if lat else None, max_latency_steps=max(lat, default=None),
                    mean_ttft_steps=sum(ttft) / len(ttft) if ttft else None,
                    preemptions=sum(len(s.preempted) for s in self.steps))


def label_of(engine) -> str:
    sc, cc = engine.config.scheduler, engine.config.cache
    admission = f" admission={','.join(sc.admission)}" if sc.admission else ""
    return (f"{sc.kv_scheduler} policy={sc.policy} preemption={sc.preemption} kv_cache={cc.kv_cache}"
            f" max_num_seqs={sc.max_num_seqs} budget={engine.scheduling.max_num_batched_tokens}{admission}")


def kv_shape(engine) -> dict[str, int]:
    return dict(num_blocks=engine.scheduling.kv_cache.num_blocks, block_size=engine.config.cache.block_size)


class RecordedPolicy(KVScheduler):
    """Makes the recorded decisions again, one step of ``steps`` per engine
    step: the recorded victims are preempted when a scheduled request's
    blocks do not fit (in the recorded order, the rest at the end of the
    step), then each scheduled request gets its recorded tokens, in batch
    order (a waiting one admitted with its prefix hit). A decision the
    engine cannot make raises ``ReplayMismatch``."""

    def __init__(self, steps: list[StepDecision]):
        super().__init__(None)
        self.steps = steps
        self.index = 0

    def schedule(self, core) -> None:
        if self.index >= len(self.steps):
            raise ReplayMismatch(f"the recording has {len(self.steps)} steps; the run needs more "
                                 f"({len(core.running)} running, {len(core.waiting)} waiting)")
        d = self.steps[self.index]
        self.index += 1
        victims = list(d.preempted)
        by_id = {r.request_id: r for r in [*core.running, *core.waiting]}

        def running(req) -> bool:
            return any(r is req for r in core.running)

        def preempt_next() -> bool:
            while victims:
                victim = by_id.get(victims.pop(0))
                if victim is not None and running(victim):
                    core.preempt(victim)
                    return True
            return False

        for name, n in d.scheduled.items():
            req = by_id.get(name)
            if req is None:
                raise ReplayMismatch(f"step {d.step}: the recording schedules {name!r}, which is neither "
                                     "running nor waiting here")
            if running(req):
                while not core.kv_cache.allocate_slots(req, n):
                    if not preempt_next():
                        raise ReplayMismatch(f"step {d.step}: {n} tokens of {name!r} do not fit the free "
                                             f"KV blocks ({core.kv_cache.num_free_blocks})")
            else:
                hit, external = core.lookup(req)
                while not core.admit(req, hit, external, n):
                    if not preempt_next():
                        raise ReplayMismatch(f"step {d.step}: admitting {name!r} with {n} tokens does not fit "
                                             f"the free KV blocks ({core.kv_cache.num_free_blocks})")
                    hit, external = core.lookup(req)
            if req.num_computed_tokens + n > req.num_tokens:
                raise ReplayMismatch(f"step {d.step}: {name!r} has {req.num_tokens - req.num_computed_tokens} "
                                     f"tokens to compute here, the recording gives it {n}")
            core.schedule_request(req, n)
        while preempt_next():
            pass


class ReplayMismatch(RuntimeError):
    """The recorded decisions cannot be made on this engine."""


def record(engine, arrivals: list[Arrival], label: str | None = None, max_steps: int = 100_000,
           policy: KVScheduler | None = None) -> Trace:
    """Run ``arrivals`` on an idle engine, each added just before its step,
    until every request has ended; the trace of what the scheduler decided.
    The run starts from fresh scheduling parts (``engine.reconfigure()``):
    an empty KV cache manager (no prefix hit left from an earlier run) and
    a fresh sampler, so two recordings start alike. ``policy``: in place of
    the engine's KV scheduler for this run (``RecordedPolicy``)."""
    if engine.has_unfinished():
        raise RuntimeError("record needs an idle engine")
    engine.reconfigure()
    if policy is not None:
        engine.scheduling.policy = policy       # these fresh parts only: the next reconfigure drops it
    names = [a.name or f"a{i}" for i, a in enumerate(arrivals)]
    if len(set(names)) != len(names):
        raise ValueError("arrival names must be unique")
    by_step: dict[int, list[tuple[str, Arrival]]] = collections.defaultdict(list)
    for name, a in zip(names, arrivals):
        if a.step < 0:
            raise ValueError(f"arrival {name}: step must be >= 0, got {a.step}")
        by_step[a.step].append((name, a))
    requests = {name: RequestTrace(name, a.step) for name, a in zip(names, arrivals)}
    live, steps = {}, []
    last = max(by_step, default=0)
    step = 0
    try:
        while step <= last or engine.has_unfinished():
            if step >= max_steps:
                raise RuntimeError(f"the run did not end within {max_steps} steps")
            for name, a in by_step.get(step, ()):
                live[name] = engine.add_request(engine.make_request(
                    list(a.prompt_token_ids), a.params, request_id=name, priority=a.priority))
            engine.step()
            sched = engine.last_schedule
            for name in sched.num_scheduled_tokens:
                if name in requests and requests[name].first_scheduled_step is None:
                    requests[name].first_scheduled_step = step
            for name, req in list(live.items()):
                t = requests[name]
                if t.first_token_step is None and req.output_token_ids:
                    t.first_token_step = step
                if req.is_finished:
                    t.finished_step, t.finish_reason = step, req.status.value
                    t.num_preemptions, t.output_token_ids = req.num_preemptions, list(req.output_token_ids)
                    del live[name]
            rm = engine.scheduling
            steps.append(StepDecision(step, dict(sched.num_scheduled_tokens), list(sched.preempted_req_ids),
                                      rm.num_running, rm.num_waiting))
            step += 1
    except BaseException:
        for name in live:
            engine.abort(name)
        if policy is not None:
            engine.reconfigure()
        raise
    trace = Trace(label or label_of(engine), list(arrivals), steps, requests, kv_shape(engine))
    if policy is not None:
        engine.reconfigure()                          # the engine's own policy again
    return trace


def replay(engine, trace: Trace, label: str | None = None, exact: bool = False, **changes) -> Trace:
    """``engine.reconfigure(**changes)``, then the trace's arrivals again:
    the trace of the other configuration (the engine keeps it). ``exact``:
    the recorded decisions instead of the scheduler's (``RecordedPolicy``;
    no ``changes``), on an engine with the recording's KV blocks."""
    if exact:
        if changes:
            raise ValueError("replay(exact=True) makes the recorded decisions: it takes no config changes")
        here = kv_shape(engine)
        for key, value in trace.kv.items():
            if here.get(key) != value:
                raise ReplayMismatch(f"the recording ran with {key}={value}, this engine has {here.get(key)}: "
                                     "its decisions would not fit")
        return record(engine, trace.arrivals, label or f"replay of {trace.label}", policy=RecordedPolicy(trace.steps))
    if changes:
        engine.reconfigure(**changes)
    return record(engine, trace.arrivals, label)


def compare(a: Trace, b: Trace) -> dict:
    """Side by side: each trace's summary; per request, latency and time to
    first token in steps under each; whether every request produced the
    same tokens (greedy requests must: scheduling changes no output); and
    the first step whose decision differs (None: the same schedule)."""
    first_divergence = next((x.step for x, y in zip(a.steps, b.steps)
                             if x.scheduled != y.scheduled or x.preempted != y.preempted), None)
    if first_divergence is None and len(a.steps) != len(b.steps):
        first_divergence = min(len(a.steps), len(b.steps))
    at = (None if first_divergence is None else
          tuple(t.steps[first_divergence] if first_divergence < len(t.steps) else None for t in (a, b)))
    return dict(
        divergence=at,            # (a's StepDecision, b's) at first_divergence (None: past a run's end)
        summary={a.label: a.summary(), b.label: b.summary()},
        latency_steps={n: (r.latency_steps, b.requests[n].latency_steps) for n, r in a.requests.items()},
        ttft_steps={n: (r.ttft_steps, b.requests[n].ttft_steps) for n, r in a.requests.items()},
        same_outputs=all(r.output_token_ids == b.requests[n].output_token_ids for n, r in a.requests.items()),
        first_divergence=first_divergence)
