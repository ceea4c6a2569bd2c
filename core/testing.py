"""A conformance kit for plugin authors: the checks fdx runs on its own
schedulers, KV caches and logits processors, parametrized by plugin name.

    # in an outside package's tests (pip install "fdx[testing]")
    from fdx.core.testing import check_scheduler, check_logits_processor

    def test_my_scheduler_keeps_the_rules():
        check_scheduler("my-sched", kv_cache="prefix", max_examples=30)

``check_scheduler`` drives the named resource manager over random
workloads (hypothesis) with a fake model whose next token is a hash of the
sequence, the real default token processor and tiny block pools, and checks
every rule of the ``ResourceManager`` contract: the step budget and
``max_num_seqs``; each scheduled request's blocks cover its tokens; the KV
it attends to is exactly what was written for its tokens (a wrong prefix
hit, a second-tier copy into the wrong block or a write into a shared block
shows up); preempted requests resume before any request that never ran; no
request waits forever; no block leaks; and every finished request's tokens
equal its solo run. The fake runner sees only the plain-data
``SchedulerOutput``, round-tripped through msgspec.

``check_proposer`` drives a speculative-decoding proposer as the engine does
and checks its contract (at most k in-vocabulary drafts) and that greedy
verification keeps every output equal to the model's own.

``check_logits_processor`` checks a processor's batch contract: applied to
a batch, each row equals what the processor does to that row alone, over
random join/leave/preemption schedules and parameter orders. ``check_equivalence`` runs an ``LLM``
against solo runs of the same prompts.
"""
from __future__ import annotations

import collections
import itertools
from typing import Any, Callable, Iterable

import numpy as np

from fdx.core.assembly import Assembly
from fdx.core.config import FdxConfig
from fdx.core.interfaces import BatchUpdate, KVCacheSpec, ModelRunnerOutput, RowState, SchedulerOutput
from fdx.core.plugins import get_plugin_manager
from fdx.core.request import Request, RequestStatus
from fdx.core.sampling_params import SamplingParams

VOCAB, EOS = 40, 0
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 2


class StubTokenizer:
    """Enough of a tokenizer for logits processors (one letter a token)."""
    eos_token_ids = [EOS]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def encode(self, text, add_special_tokens=False) -> list[int]:
        return [(ord(c) - 97) % VOCAB for c in text]


def next_token(tokens: list[int]) -> int:
    """The fake model: a hash of the last tokens and the length."""
    h = (tokens[-1] * 2654435761 + (tokens[-2] if len(tokens) > 1 else 7) * 40503 + len(tokens) * 97) % 1000003
    return h % VOCAB


def reference_output(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    toks, out = list(prompt), []
    limit = min(max_tokens, max_model_len - len(prompt))
    while True:
        t = next_token(toks)
        toks.append(t)
        out.append(t)
        if t == EOS or len(out) >= limit or len(toks) >= max_model_len:
            return out


def kv_value(tokens: np.ndarray, positions: np.ndarray, layer: int, j: int, head: int) -> np.ndarray:
    """[n, HEAD_DIM] float32 values that identify (token, position, layer, k/v, head)."""
    a = tokens * 1000.0 + positions
    b = np.full_like(a, layer * 100 + j * 10 + head)
    return np.stack([a, b], axis=1).astype(np.float32)


class FakeRunner:
    """A model runner fed only plain data: it keeps its own per-request
    state, checks the KV each request attends to, writes the new tokens' KV
    and samples the fake model's next token."""

    def __init__(self, kv_caches, block_size: int, num_slots: int, connector=None):
        import msgspec
        self.kv_caches, self.bs, self.num_slots = kv_caches, block_size, num_slots
        self.connector = connector
        self.state: dict[str, dict] = {}
        self.decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self.encoder = msgspec.msgpack.Encoder()

    def _rows(self, table, positions, head):
        table = np.asarray(table, dtype=np.int64)
        return head * self.num_slots + table[positions // self.bs] * self.bs + positions % self.bs

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        import paddle
        meta = sched.kv_connector_metadata
        sched.kv_connector_metadata = None           # connector data is the connector's own business
        sched = self.decoder.decode(self.encoder.encode(sched))   # the runner sees a decoded copy only
        for rid in sched.finished_req_ids:
            self.state.pop(rid, None)
        for nr in sched.new_requests:
            assert nr.request_id not in self.state, f"{nr.request_id} sent as new twice"
            self.state[nr.request_id] = dict(tokens=nr.prompt_token_ids + nr.output_token_ids,
                                             table=list(nr.block_ids), computed=nr.num_computed_tokens)
        for cr in sched.cached_requests:
            st = self.state[cr.request_id]
            assert st["computed"] == cr.num_computed_tokens, f"{cr.request_id}: computed tokens disagree"
            st["table"].extend(cr.new_block_ids)
        if self.connector is not None:
            self.connector.start_load_kv(meta)
        out = ModelRunnerOutput()
        snapshot = [(k.numpy(), v.numpy()) for k, v in self.kv_caches]
        writes = collections.defaultdict(list)
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.state[rid]
            ctx, table = st["computed"], st["table"]
            tokens = np.asarray(st["tokens"][:ctx + n], dtype=np.int64)
            assert ctx + n <= len(st["tokens"]), f"{rid}: scheduled past its known tokens"
            assert len(table) * self.bs >= ctx + n, f"{rid}: block table too short"
            assert len(set(table)) == len(table), f"{rid}: a block twice in one table"
            ctx_pos, new_pos = np.arange(ctx), np.arange(ctx, ctx + n)
            for layer, j, h in itertools.product(range(NUM_LAYERS), range(2), range(NUM_KV_HEADS)):
                got = snapshot[layer][j][self._rows(table, ctx_pos, h)]
                assert np.array_equal(got, kv_value(tokens[:ctx], ctx_pos, layer, j, h)), \
                    f"{rid}: wrong KV in its context"
                writes[layer, j].append((self._rows(table, new_pos, h), kv_value(tokens[ctx:], new_pos, layer, j, h)))
            st["computed"] = ctx + n
            if ctx + n == len(st["tokens"]):
                token = next_token(st["tokens"])
                st["tokens"].append(token)
                out.sampled[rid] = token
        for (layer, j), parts in writes.items():
            rows = np.concatenate([r for r, _ in parts])
            vals = np.concatenate([v for _, v in parts])
            assert len(np.unique(rows)) == len(rows), "two requests write one KV slot in a step"
            self.kv_caches[layer][j].scatter_(paddle.to_tensor(rows), paddle.to_tensor(vals), overwrite=True)
        if self.connector is not None:
            sending, recving = self.connector.get_finished()
            out.finished_sending, out.finished_recving = sorted(sending), sorted(recving)
        return out


def workloads(max_requests: int = 12):
    """A hypothesis strategy of small workloads that stress pools and budgets."""
    from hypothesis import strategies as st

    @st.composite
    def build(draw):
        bs = draw(st.sampled_from([2, 4]))
        max_model_len = draw(st.sampled_from([12, 16, 24]))
        need = -(-max_model_len // bs)
        num_blocks = draw(st.integers(max(2, need // 2), need + 8))
        chunked = draw(st.booleans())
        budget = draw(st.integers(1, 2 * max_model_len) if chunked else st.integers(max_model_len, 2 * max_model_len))
        prefixes = draw(st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=max_model_len,
                                          max_size=max_model_len), min_size=1, max_size=3))
        requests = []
        for _ in range(draw(st.integers(1, max_requests))):
            length = draw(st.integers(1, max_model_len - 1))
            shared = draw(st.one_of(st.just(length), st.integers(0, length)))
            prompt = draw(st.sampled_from(prefixes))[:shared] + draw(
                st.lists(st.integers(1, VOCAB - 1), min_size=length - shared, max_size=length - shared))
            requests.append(dict(
                arrival=draw(st.integers(0, 30)), prompt=prompt, max_tokens=draw(st.integers(1, 10)),
                priority=draw(st.integers(0, 3)), salt=draw(st.sampled_from([None, None, "s"])),
                abort_after=draw(st.one_of(st.none(), st.integers(0, 15)))))
        return dict(bs=bs, max_model_len=max_model_len, num_blocks=num_blocks, chunked=chunked, budget=budget,
                    max_num_seqs=draw(st.integers(1, 5)), swap=draw(st.sampled_from([0, 3, 12])),
                    requests=requests)
    return build()


def run_workload(kv_scheduler: str, kv_cache: str, policy: str, w: dict, *, preemption: str = "newest",
                 admission: Iterable[str] = (), plugins: dict | None = None,
                 audit: Callable[[Any, Any], None] | None = None, plugin_manager=None):
    """Run one workload through the named plugins (``plugins``: their
    settings, as the config section; ``plugin_manager``: where to find them,
    default the process's); check every rule; return (requests by id, the
    KV cache, the resource manager)."""
    import paddle
    pm = plugin_manager or get_plugin_manager()
    cfg = FdxConfig.build(kv_scheduler=kv_scheduler, kv_cache=kv_cache, policy=policy,
                          preemption=preemption, admission=list(admission), block_size=w["bs"],
                          max_num_seqs=w["max_num_seqs"], max_num_batched_tokens=w["budget"],
                          enable_chunked_prefill=w["chunked"], plugins=plugins or {},
                          **({"kv_connector": "swap", "plugins.connector.swap.max_blocks": w["swap"]}
                             if w["swap"] else {}))
    assembly = Assembly(cfg, pm)            # the engine's assembly, scheduler side
    tp = assembly.token_processor()
    parts = assembly.scheduler_side(w["num_blocks"], tp, w["max_model_len"])
    kv, connector, rm = parts["kv_cache"], parts["connector"], parts["scheduling"]
    num_slots = w["num_blocks"] * w["bs"]
    kv_caches = [(paddle.zeros([NUM_KV_HEADS * num_slots, HEAD_DIM]), paddle.zeros([NUM_KV_HEADS * num_slots, HEAD_DIM]))
                 for _ in range(NUM_LAYERS)]
    if connector is not None:
        connector.register_kv_caches(kv_caches, KVCacheSpec(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, w["num_blocks"],
                                                            w["bs"], "float32"))
    runner = FakeRunner(kv_caches, w["bs"], num_slots, connector)

    reqs: dict[str, Request] = {}
    events = collections.defaultdict(list)
    for i, spec in enumerate(w["requests"]):
        events[spec["arrival"]].append(("add", i, spec))
        if spec["abort_after"] is not None:
            events[spec["arrival"] + spec["abort_after"]].append(("abort", i, spec))
    last_event = max(events)
    total = sum(len(s["prompt"]) + s["max_tokens"] for s in w["requests"])
    bound = last_event + 10 * total + 20
    ever_ran: set[str] = set()
    refused: set[str] = set()                     # this step's admission refusals
    may_admit = rm.may_admit

    def recording_may_admit(request):
        ok = may_admit(request)
        if not ok:
            refused.add(request.request_id)
        return ok
    rm.may_admit = recording_may_admit
    bounded = rm.policy.bounded_wait
    step = 0
    while step <= last_event or rm.has_unfinished():
        assert step < bound, f"no progress after {step} steps: {rm.num_running} running, {rm.num_waiting} waiting"
        for what, i, spec in events.get(step, ()):
            if what == "add":
                req = Request(f"r{i}", list(spec["prompt"]), SamplingParams(temperature=0, max_tokens=spec["max_tokens"]),
                              priority=spec["priority"], cache_salt=spec["salt"],
                              eos_token_ids=frozenset({EOS}), max_model_len=w["max_model_len"])
                tp.start(req)
                rm.add_request(req)
                reqs[req.request_id] = req
            else:
                aborted = rm.abort_request(f"r{i}")
                assert aborted is None or aborted.status is RequestStatus.FINISHED_ABORTED
        rm.pop_finished()
        waiting_preempted = {r.request_id for r in rm.requests() if r.status is RequestStatus.PREEMPTED}
        rm.waiting.reorder()                      # the queue order this step's schedule() sees
        order = list(rm.waiting)
        refused.clear()
        sched = rm.schedule()
        check_schedule(sched, rm, cfg, waiting_preempted, ever_ran)
        if bounded:
            check_bounded_wait(order, rm, refused)
        ever_ran |= set(sched.num_scheduled_tokens)
        if not sched.is_empty or sched.kv_connector_metadata is not None:
            rm.update(sched, runner.execute(sched))
        check_blocks(rm, kv)
        if audit is not None:
            audit(rm, kv)
        step += 1

    assert kv.num_free_blocks == w["num_blocks"], "blocks leaked"
    for spec_i, spec in enumerate(w["requests"]):
        req = reqs[f"r{spec_i}"]
        assert req.is_finished, f"{req.request_id} never finished"
        assert not kv.block_table(req.request_id), f"{req.request_id} finished holding blocks"
        want = reference_output(spec["prompt"], spec["max_tokens"], w["max_model_len"])
        if req.status is RequestStatus.FINISHED_REJECTED:
            assert isinstance(req.stop_reason, str) and req.stop_reason.startswith("rejected")
            assert -(-min(len(spec["prompt"]) + spec["max_tokens"], w["max_model_len"]) // w["bs"]) > w["num_blocks"]
        elif req.status is RequestStatus.FINISHED_ABORTED:
            assert req.output_token_ids == want[:len(req.output_token_ids)]
        else:
            assert req.output_token_ids == want, f"{req.request_id}: output differs from the solo run"
    return reqs, kv, rm


def check_schedule(sched: SchedulerOutput, rm, cfg: FdxConfig, waiting_preempted: set[str], ever_ran: set[str]) -> None:
    """The per-step rules of the ResourceManager contract."""
    sc = cfg.scheduler
    by_id = {r.request_id: r for r in rm.requests()}
    assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
    assert sched.total_num_scheduled_tokens <= sc.max_num_batched_tokens, "over the step budget"
    assert len(sched.num_scheduled_tokens) <= sc.max_num_seqs and rm.num_running <= sc.max_num_seqs
    ids = [d.request_id for d in sched.new_requests] + [d.request_id for d in sched.cached_requests]
    assert sorted(ids) == sorted(sched.num_scheduled_tokens), "scheduled ids and request data disagree"
    resumed = [rid for rid in sched.num_scheduled_tokens if rid in waiting_preempted]
    fresh = [rid for rid in sched.num_scheduled_tokens if rid not in ever_ran]
    if fresh:
        still_waiting = waiting_preempted - set(resumed) - set(sched.num_scheduled_tokens)
        assert not still_waiting, f"new requests {fresh} ran while preempted {sorted(still_waiting)} waited"
    for rid, n in sched.num_scheduled_tokens.items():
        req = by_id[rid]
        assert n >= 1
        assert req.status is RequestStatus.RUNNING
        assert req.num_computed_tokens + n <= req.num_tokens
        assert len(rm.kv_cache.block_table(rid)) * rm.kv_cache.block_size >= req.num_computed_tokens + n, \
            f"{rid} scheduled without the blocks for its tokens"
        if not sc.enable_chunked_prefill:
            assert req.num_computed_tokens + n == req.num_tokens, "a chunk without chunking"


def check_bounded_wait(order: list[Request], rm, refused: set[str]) -> None:
    """Bounded wait: no waiting request is passed over. ``order`` is the
    waiting queue as the step began (preempted first, then the queue
    policy's order); a request that started in the step (left the queue,
    not finished) may do so only if every request ahead of it started too,
    ended, or was refused by an admission rule (or the connector) in that
    step. Under fcfs a request so waits only for the requests that arrived
    before it, never for later ones."""
    waiting = {r.request_id for r in rm.waiting}
    passed = []                          # ahead of a started one, neither started nor refused
    for req in order:
        rid = req.request_id
        started = rid not in waiting and not req.is_finished
        if started and passed:
            raise AssertionError(
                f"bounded wait: {rid} started while {', '.join(passed)}, ahead of it in the waiting queue "
                "and not refused by an admission rule, kept waiting (a policy that passes requests over on "
                "purpose declares bounded_wait = False)")
        if not started and rid in waiting and rid not in refused:
            passed.append(rid)


def check_blocks(rm, kv) -> None:
    """Blocks held by waiting requests, and the pool's count."""
    held = set()
    for req in rm.requests():
        table = kv.block_table(req.request_id)
        if req.status is not RequestStatus.RUNNING:
            assert not table, f"{req.request_id} waits holding blocks"
        held |= set(table)
    assert len(held) + kv.num_free_blocks <= kv.num_blocks, "more blocks held and free than exist"


def check_scheduler(kv_scheduler: str, kv_cache: str = "paged", policy: str = "fcfs", *,
                    preemption: str = "newest", admission: Iterable[str] = (), plugins: dict | None = None,
                    max_examples: int = 30, max_requests: int = 12, audit=None, plugin_manager=None) -> None:
    """Property-check a KV scheduler (and cache, queue policy, victim
    policy, admission rules) over ``max_examples`` random workloads."""
    import pprint

    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=max_examples, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    @given(w=workloads(max_requests))
    def run(w):
        try:
            run_workload(kv_scheduler, kv_cache, policy, w, preemption=preemption, admission=admission,
                         plugins=plugins, audit=audit, plugin_manager=plugin_manager)
        except AssertionError as e:
            # the workload in full, ready to paste: hypothesis alone prints "run(w=,)" for it
            call = (f"run_workload({kv_scheduler!r}, {kv_cache!r}, {policy!r}, w, preemption={preemption!r}, "
                    f"admission={list(admission)!r}, plugins={plugins!r})")
            raise AssertionError(f"{e}\n\nthe failing workload (fdx.core.testing.{call}):\n"
                                 f"w = {pprint.pformat(w, width=110, compact=True)}") from e
    run()


def join_leave_schedule(rng: np.random.Generator, num_requests: int, num_steps: int) -> list[list[int]]:
    """A random batch schedule: for each step, the requests in the batch, in
    row order. Request 0 alone starts it; every other request joins later
    (at a step of its own), each leaves once and comes back (a preemption)
    and may also leave for good (finished) near the end; rows are shuffled
    whenever the batch changes, as a runner may order them."""
    joins = {0: 0, **{i: int(j) for i, j in zip(range(1, num_requests),
                                                 rng.choice(np.arange(1, num_steps // 2), num_requests - 1,
                                                            replace=num_requests - 1 > num_steps // 2 - 1))}}
    gaps = {}
    for i, j in joins.items():
        start = int(rng.integers(j + 1, max(j + 2, num_steps - 3)))
        gaps[i] = range(start, start + int(rng.integers(1, 4)))
    finish = {i: (int(rng.integers(num_steps - 3, num_steps)) if rng.random() < 0.3 else num_steps)
              for i in joins}
    schedule, last = [], []
    for step in range(num_steps):
        members = [i for i in range(num_requests) if joins[i] <= step < finish[i] and step not in gaps[i]]
        if not members:
            continue                              # a step with no row samples nothing
        if sorted(last) == members and rng.random() >= 0.2:
            rows = list(last)                     # the same rows in the same order: rows_changed False
        else:
            rows = [members[k] for k in rng.permutation(len(members))]
        schedule.append(rows)
        last = rows
    return schedule


def check_logits_processor(name: str, params: list[SamplingParams], *, vocab_size: int = 64,
                           tokenizer: Any = None, settings: dict | None = None, seed: int = 0,
                           num_schedules: int = 6, num_steps: int = 16, plugin_manager=None) -> None:
    """A processor's batch contract: over random schedules in which requests
    join, leave, come back (as after a preemption) and change rows, each row
    of the batch result equals the processor applied to that request alone
    (a solo instance told only about that request, at the steps it is in the
    batch). Each schedule gives the parameters to the requests in another
    order (the given order, reversed, then random), each parameter set to
    two requests that join at different steps. A processor that keeps
    batch-wide state where per-request state is meant (counting the batch's
    steps instead of each request's tokens) fails."""
    pm = plugin_manager or get_plugin_manager()
    cls = pm.get("logits_processor", name)
    cfg = FdxConfig()
    tokenizer = tokenizer or StubTokenizer()
    rng = np.random.default_rng(seed)
    for p in params:
        cls.validate_params(p)
    for trial in range(num_schedules):
        order = (list(range(len(params))) if trial == 0 else list(range(len(params)))[::-1] if trial == 1
                 else [int(i) for i in rng.permutation(len(params))])
        assigned = [params[i] for i in order] * 2
        schedule = join_leave_schedule(rng, len(assigned), num_steps)
        try:
            _run_processor_schedule(pm, cls, name, assigned, schedule, rng, cfg, tokenizer, vocab_size, settings)
        except AssertionError as e:
            raise AssertionError(
                f"{e}\nparameter order {order} (request q<i> has params[order[i % {len(params)}]]); "
                f"batch rows per step (request indices): {schedule}") from None


def _run_processor_schedule(pm, cls, name, assigned, schedule, rng, cfg, tokenizer, vocab_size, settings) -> None:
    from fdx.core.interfaces import BuildContext
    from fdx.core.plugins import make_plugin

    def make():                                  # as the engine builds it (settings None: the config's)
        ctx = BuildContext(cfg, pm, "logits_processor", name, tokenizer=tokenizer, vocab_size=vocab_size)
        return make_plugin(ctx, "decoding.logits_processors", cls=cls,
                           **({} if settings is None else {"settings": settings}))
    batch_proc = make()
    rids = [f"q{i}" for i in range(len(assigned))]
    solo = {rid: make() for rid in rids}
    outputs = {rid: [] for rid in rids}
    rows_state = {rid: RowState(rid, assigned[i], [int(t) for t in rng.integers(1, vocab_size, int(rng.integers(1, 6)))],
                                outputs[rid]) for i, rid in enumerate(rids)}
    present: set[str] = set()
    last_rows: list[str] | None = None
    for step, indices in enumerate(schedule):
        rows = [rids[i] for i in indices]
        gone = sorted(present - set(rows))
        added = [rid for rid in rows if rid not in present]
        logits = rng.standard_normal((len(rows), vocab_size)).astype(np.float32)
        batch_proc.update_state(BatchUpdate([rows_state[r] for r in added], gone, rows, rows != last_rows))
        got = batch_proc.apply(logits.copy())
        for rid in gone:                              # left: the solo processor forgets it too
            solo[rid].update_state(BatchUpdate([], [rid], [], True))
        for k, rid in enumerate(rows):
            one = solo[rid]
            one.update_state(BatchUpdate([rows_state[rid]] if rid in added else [], [], [rid], rid in added))
            want = one.apply(logits[k:k + 1].copy())
            np.testing.assert_array_equal(got[k], want[0], err_msg=f"{name}: row {k} ({rid}) at step {step}")
        for rid in rows:
            outputs[rid].append(int(rng.integers(vocab_size)))
        present, last_rows = set(rows), rows


def check_equivalence(llm, prompts: list, sampling_params: SamplingParams | None = None) -> None:
    """The outputs of a batch equal each prompt's solo run on the same LLM."""
    sp = sampling_params or SamplingParams(temperature=0, max_tokens=8)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert together == alone, "batched outputs differ from solo runs"


def _copy_model(tokens: list[int], period: int) -> int:
    """The kit's fake model for proposers: mostly copies the token
    ``period`` back (input-grounded text), sometimes the hash model's."""
    t = next_token(tokens)
    return tokens[-period] if len(tokens) >= period and t % 4 else t


def check_proposer(name: str, *, k: int = 4, num_requests: int = 16, max_tokens: int = 40, seed: int = 0,
                   plugins=None, config: FdxConfig | None = None) -> dict[str, float]:
    """Drive the proposer registered as ``name`` over random requests the
    way the engine does (``add_request``, ``propose`` then ``on_accepted``
    each step, ``on_preempted`` at random, ``remove_request`` at the end)
    against a fake model that mostly copies its input, verifying the drafts
    greedily (``fdx.core.spec.accept_sampled``). Checks: every proposal is
    at most k tokens of the vocabulary (else ``ProposerError`` naming the
    proposer), and every request's output equals the fake model's own run
    token for token (lossless whatever it proposes). Returns the
    acceptance rate and mean accepted length."""
    from fdx.core.spec import Speculation, accept_sampled
    rng = np.random.default_rng(seed)
    pm = plugins or get_plugin_manager()
    cfg = config or FdxConfig.build(speculative={"method": name, "num_speculative_tokens": k, "cost_gate": False})
    spec = Speculation(cfg, pm, VOCAB)
    live: list[tuple[Request, int, list[int]]] = []
    for i in range(num_requests):
        period = int(rng.integers(2, 12))
        base = rng.integers(1, VOCAB, period).tolist()
        prompt = (base * int(rng.integers(1, 4)) + base[:int(rng.integers(0, period))])
        req = Request(f"kit-{i}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                      eos_token_ids=frozenset({EOS}), max_model_len=512)
        toks, ref = list(prompt), []
        for _ in range(max_tokens):
            toks.append(_copy_model(toks, period))
            ref.append(toks[-1])
        spec.add_request(req)
        live.append((req, period, ref))
    spec.begin_step(len(live))
    for req, period, ref in live:
        while len(req.output_token_ids) < max_tokens:
            room = min(k, max_tokens - len(req.output_token_ids) - 1)
            drafts = spec.drafts(req, room) if room > 0 else []
            toks = [*req.prompt_token_ids, *req.output_token_ids]
            sampled = []
            for j in range(len(drafts) + 1):
                sampled.append(_copy_model(toks + drafts[:j], period))
            kept = accept_sampled(drafts, sampled)
            req.output_token_ids.extend(kept)
            if drafts:
                spec.on_accepted(req, len(drafts), len(kept) - 1)
            if rng.random() < 0.05:
                spec.preempted(req)
        assert req.output_token_ids == ref, (f"proposer {name!r}: request {req.request_id} differs from the "
                                             "model's own output")
        spec.remove_request(req)
    spec.close()
    c = spec.counters
    return {"acceptance_rate": c.acceptance_rate, "mean_accepted_length": c.mean_accepted_length}
