"""The experiment API (docs/research.md, issue 19): the page's notebook runs
as written on a tiny model, its numbers are recomputed here from the step
decisions and from the scheduling rules, its tokens equal transformers';
reconfigure keeps the model and KV tensors, refuses what needs a reload
(naming the key) and works with a fresh FdxConfig.build."""
from __future__ import annotations

import pathlib
import re

import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError, FdxConfig

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "research.md"


@pytest.fixture(scope="module")
def notebook(tiny_checkpoints):
    """The page's code blocks, run in order in one namespace."""
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    mp = pytest.MonkeyPatch()
    mp.setenv("FDX_MODEL", str(path))
    ns: dict = {}
    try:
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)):
            exec(compile(code, f"docs/research.md block {i}", "exec"), ns)
    finally:
        mp.undo()
    return ns, hf


def recomputed(trace) -> dict[str, tuple[int, int]]:
    """(first scheduled step, last scheduled step) of each request, from the step decisions alone."""
    seen: dict[str, list[int]] = {}
    for s in trace.steps:
        for name in s.scheduled:
            seen.setdefault(name, []).append(s.step)
    return {name: (steps[0], steps[-1]) for name, steps in seen.items()}


def test_the_notebook_runs_and_its_numbers_follow_from_the_decisions(notebook):
    ns, _ = notebook
    for trace in (ns["fcfs"], ns["sjf"]):
        for name, (first, last) in recomputed(trace).items():
            r = trace.requests[name]
            assert (r.first_scheduled_step, r.finished_step) == (first, last)   # the last token's step
            assert r.latency_steps == last - r.arrival_step + 1
        assert trace.summary()["tokens"] == 60 + 3 * 3 + 4 * 3        # prompts + decodes (the first token rides the prefill)
    # one sequence at a time, a 32-token budget, 4 tokens each: the long prompt's prefill takes
    # 2 steps (its first token with the second), then 3 decodes: 5 steps; a short one 1 + 3: 4 steps
    fcfs = {n: r.latency_steps for n, r in ns["fcfs"].requests.items()}
    sjf = {n: r.latency_steps for n, r in ns["sjf"].requests.items()}
    assert fcfs == {"long": 5, "short0": 9, "short1": 13, "short2": 17}
    assert sjf == {"short0": 4, "short1": 8, "short2": 12, "long": 17}
    assert ns["result"]["latency_steps"] == {n: (fcfs[n], sjf[n]) for n in fcfs}


def test_the_notebook_tokens_equal_transformers(notebook):
    from test_llm import hf_greedy
    ns, hf = notebook
    for a in ns["arrivals"]:
        got = ns["fcfs"].requests[a.name].output_token_ids
        assert got == hf_greedy(hf, a.prompt_token_ids, 4, follow=got), a.name
    assert ns["first"].output_token_ids == hf_greedy(hf, [1, 2, 3, 4, 5], 4, follow=ns["first"].output_token_ids)


def make_llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["Qwen2ForCausalLM"][0]), max_model_len=64, num_kv_blocks=40, block_size=4,
               max_num_batched_tokens=16, max_num_seqs=3, progress=False)


@pytest.fixture()
def llm(tiny_checkpoints):
    return make_llm(tiny_checkpoints)


@pytest.fixture(scope="module")
def shared_llm(tiny_checkpoints):
    """For the refusals, which change nothing."""
    return make_llm(tiny_checkpoints)


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 9, 200, 31, 7]}, {"prompt_token_ids": list(range(60, 90))},
           {"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}]


def test_reconfigure_keeps_model_and_tensors_and_outputs(llm):
    eng = llm.engine
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    model, tensors, rm = eng.model, eng.kv_caches, eng.resource_manager
    eng.reconfigure(resource_manager="v0", policy="priority", kv_cache="prefix", max_num_seqs=1, num_kv_blocks=30)
    assert eng.model is model and eng.kv_caches is tensors and eng.resource_manager is not rm
    assert type(eng.resource_manager.policy).__name__ == "V0Policy" and eng.kv_cache.num_blocks == 30
    assert eng.config.scheduler.policy == "priority" and eng.config.cache.kv_cache == "prefix"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    # a fresh config: only its explicitly set keys apply
    eng.reconfigure(config=FdxConfig.build(resource_manager="v1", preemption="least-computed"))
    assert eng.config.scheduler.policy == "priority" and eng.config.scheduler.max_num_seqs == 1
    assert type(eng.resource_manager.policy).__name__ == "V1Policy"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


def test_reconfigure_swaps_the_logits_processors(llm, example_plugin_installed):
    """The outside stop-after processor, added by reconfigure: the same
    request that ran 6 tokens now ends with EOS after 2."""
    from fdx.core.plugins import PluginManager
    eng = LLM(str(llm.engine.model_path), plugins=PluginManager(), max_model_len=64, num_kv_blocks=40,
              block_size=4, progress=False).engine
    sp = SamplingParams(temperature=0, max_tokens=6, extra_args={"stop_after": 2})

    def run():
        req = eng.add_request(eng.make_request([5, 9, 200], sp))
        while eng.has_unfinished():
            eng.step()
        return req
    before = run()
    eng.reconfigure(logits_processors=["stop-after"])
    assert "stop-after" in eng.assembly.processor_names
    after = run()
    assert len(before.output_token_ids) == 6 and set(before.output_token_ids).isdisjoint(eng.eos_token_ids)
    assert after.output_token_ids == before.output_token_ids[:2] + [after.output_token_ids[2]]
    assert after.output_token_ids[2] in eng.eos_token_ids


@pytest.mark.parametrize("change,key", [
    (dict(block_size=8), "cache.block_size"), (dict(max_model_len=32), "model.max_model_len"),
    (dict(model="elsewhere"), "model.model"), (dict(quantization="wint8"), "model.quantization"),
    (dict(dtype="float16"), "model.dtype"), (dict(backend="cuda"), "backend.name"),
    (dict(tensor_parallel_size=2), "parallel.tensor_parallel_size"), (dict(num_kv_blocks=41), "cache.num_kv_blocks"),
    (dict(policy="nope"), "scheduler.policy"),
])
def test_reconfigure_refuses_what_needs_a_reload_and_changes_nothing(shared_llm, change, key):
    eng = shared_llm.engine
    rm, cfg = eng.resource_manager, eng.config
    with pytest.raises(ConfigError, match=re.escape(f"config key '{key}'")):
        eng.reconfigure(**change)
    assert eng.resource_manager is rm and eng.config is cfg


def test_reconfigure_needs_an_idle_engine_and_abort_frees(llm):
    eng = llm.engine
    req = eng.add_request(eng.make_request([5, 9, 200], GREEDY))
    eng.step()
    with pytest.raises(RuntimeError, match="idle engine: 1 requests are unfinished"):
        eng.reconfigure(policy="priority")
    assert eng.abort(req.request_id) is req and req.is_finished
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks
    eng.reconfigure(policy="priority")


def test_build_parts_with_a_fresh_config(llm):
    """The root fix: a fresh config's unresolved budget (None) resolves where the step is built."""
    fresh = FdxConfig.build(policy="fcfs", enable_chunked_prefill=True)
    assert fresh.scheduler.max_num_batched_tokens is None
    parts = llm.engine.build_parts(fresh, 20)
    assert parts["scheduling"].max_num_batched_tokens == 2048
    unchunked = FdxConfig.build(enable_chunked_prefill=False)
    assert llm.engine.build_parts(unchunked, 20)["scheduling"].max_num_batched_tokens == 64


@pytest.mark.slow
def test_reconfigure_under_tensor_parallel_goes_through_the_executor(tiny_checkpoints):
    """TP 2: the workers (and their KV shards) stay; the scheduler side
    changes in the engine, the runner side (here the sampler's seed) on every
    rank through the executor; outputs stay transformers'; a connector,
    which does not run under tensor parallel, is refused naming its key."""
    from test_llm import hf_greedy
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    ids = [[5, 9, 200, 31, 7], list(range(60, 90)), [3, 1, 4]]
    with LLM(str(path), tensor_parallel_size=2, max_model_len=64, num_kv_blocks=40, block_size=4,
             max_num_batched_tokens=16, progress=False) as llm:
        eng = llm.engine
        pids = [p.pid for p in eng.executor.procs]
        eng.reconfigure(policy="priority", preemption="least-computed", kv_cache="prefix", max_num_seqs=1, seed=7)
        assert [p.pid for p in eng.executor.procs] == pids and eng.config.scheduler.max_num_seqs == 1
        assert eng.config.seed == 7
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY)
        for p, o in zip(ids, outs):
            assert o.outputs[0].token_ids == hf_greedy(hf, p, 6, follow=o.outputs[0].token_ids)
        with pytest.raises(ConfigError, match=re.escape("config key 'cache.kv_connector'")):
            eng.reconfigure(kv_connector="swap")
        assert eng.config.cache.kv_connector is None and eng.config.seed == 7     # nothing changed
        assert llm.generate([{"prompt_token_ids": ids[2]}], GREEDY)[0].outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_exact_replay_remakes_the_recorded_decisions(llm, tiny_checkpoints):
    """A v1 run with chunked prefill and preemption, replayed exactly
    (``replay(exact=True)``: the recorded decisions through the normal
    engine) is the same run step for step, with the same greedy tokens,
    which equal transformers'; another configuration's first differing
    step is reported; a recording that does not fit the engine is refused."""
    from test_llm import hf_greedy

    from fdx.core.replay import Arrival, ReplayMismatch, compare, record, replay
    eng, hf = llm.engine, tiny_checkpoints["Qwen2ForCausalLM"][1]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    arrivals = [Arrival(0, list(range(10 + 7 * i, 46 + 7 * i)), greedy, name=f"r{i}") for i in range(3)]
    arrivals.append(Arrival(4, [7, 8, 9, 10], greedy, name="late"))
    rec = record(eng, arrivals)
    decisions = [(s.scheduled, s.preempted) for s in rec.steps]
    assert sum(len(p) for _, p in decisions) > 0                          # blocks ran out: preemption
    assert any(1 < n < 36 for sched, _ in decisions for n in sched.values())   # a prefill chunk

    again = replay(eng, rec, exact=True)
    assert [(s.scheduled, s.preempted) for s in again.steps] == decisions
    result = compare(rec, again)
    assert result["first_divergence"] is None and result["divergence"] is None and result["same_outputs"]
    for a in arrivals:
        got = again.requests[a.name].output_token_ids
        assert got == rec.requests[a.name].output_token_ids
        assert got == hf_greedy(hf, a.prompt_token_ids, 20, follow=got), a.name

    assert compare(rec, replay(eng, rec))["first_divergence"] is None     # v1 re-makes its own decisions
    other = replay(eng, rec, max_num_seqs=1)
    result = compare(rec, other)
    first = result["first_divergence"]
    assert first == next(i for i, (a, b) in enumerate(zip(rec.steps, other.steps))
                         if (a.scheduled, a.preempted) != (b.scheduled, b.preempted))
    mine, theirs = result["divergence"]
    assert mine is rec.steps[first] and theirs is other.steps[first] and mine.scheduled != theirs.scheduled
    eng.reconfigure(max_num_seqs=3)
    forced = replay(eng, other, exact=True)        # the one-at-a-time schedule, fed to a max_num_seqs=3 engine
    assert [(s.scheduled, s.preempted) for s in forced.steps] == [(s.scheduled, s.preempted) for s in other.steps]
    assert compare(rec, forced)["first_divergence"] == first
    assert all(forced.requests[n].output_token_ids == r.output_token_ids for n, r in rec.requests.items())

    eng.reconfigure(num_kv_blocks=30)
    with pytest.raises(ReplayMismatch, match="num_blocks=40, this engine has 30"):
        replay(eng, rec, exact=True)
    eng.reconfigure(num_kv_blocks=40)
    tampered = record(eng, arrivals)
    step = next(s for s in tampered.steps if s.scheduled)
    name = next(iter(step.scheduled))
    step.scheduled[name] += 1000
    with pytest.raises(ReplayMismatch, match=f"step {step.step}: .*{name!r}"):
        replay(eng, tampered, exact=True)
    assert not eng.has_unfinished()                                       # the failed replay left nothing
    with pytest.raises(ValueError, match="no config changes"):
        replay(eng, rec, exact=True, policy="fcfs")


def test_the_notebook_steering_changes_one_request_of_eight(notebook):
    """docs/research.md's activation-hook block: the steered request's
    outputs moved, the seven others' tokens and logprobs bit for bit those of
    the batch without hooks, and its capture is the stream plus the vector."""
    ns, _ = notebook
    assert ns["unchanged"] == [0, 1, 3, 4, 5, 6, 7]
    assert ns["seen"](ns["after"][2]) != ns["seen"](ns["before"][2])
    assert ns["captured"].positions == [0, 1, 2, 3]
