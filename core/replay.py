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
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

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
    return (f"{sc.resource_manager} policy={sc.policy} preemption={sc.preemption} kv_cache={cc.kv_cache}"
            f" max_num_seqs={sc.max_num_seqs} budget={engine.resource_manager.max_num_batched_tokens}{admission}")


def record(engine, arrivals: list[Arrival], label: str | None = None, max_steps: int = 100_000) -> Trace:
    """Run ``arrivals`` on an idle engine, each added just before its step,
    until every request has ended; the trace of what the scheduler decided.
    The run starts from fresh scheduling parts (``engine.reconfigure()``):
    an empty KV cache manager (no prefix hit left from an earlier run) and
    a fresh sampler, so two recordings start alike."""
    if engine.has_unfinished():
        raise RuntimeError("record needs an idle engine")
    engine.reconfigure()
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
            rm = engine.resource_manager
            steps.append(StepDecision(step, dict(sched.num_scheduled_tokens), list(sched.preempted_req_ids),
                                      rm.num_running, rm.num_waiting))
            step += 1
    except BaseException:
        for name in live:
            engine.abort(name)
        raise
    return Trace(label or label_of(engine), list(arrivals), steps, requests)


def replay(engine, trace: Trace, label: str | None = None, **changes) -> Trace:
    """``engine.reconfigure(**changes)``, then the trace's arrivals again:
    the trace of the other configuration (the engine keeps it)."""
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
    return dict(
        summary={a.label: a.summary(), b.label: b.summary()},
        latency_steps={n: (r.latency_steps, b.requests[n].latency_steps) for n, r in a.requests.items()},
        ttft_steps={n: (r.ttft_steps, b.requests[n].ttft_steps) for n, r in a.requests.items()},
        same_outputs=all(r.output_token_ids == b.requests[n].output_token_ids for n, r in a.requests.items()),
        first_divergence=first_divergence)
