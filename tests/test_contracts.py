"""The plugin contracts, proven from outside: the plain-data step, core's
imports, backends choosing kernels, the plugins of tests/plugin_pkg (one per
contract, written against fdx.core only) selected by config end to end, the
conformance kit run on them, plugin settings, observers and research taps."""
from __future__ import annotations

import ast
import functools
import pathlib
import re

import msgspec
import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from fdx.core.interfaces import SchedulerOutput
from fdx.core.plugins import PluginManager, get_plugin_manager
from fdx.core.testing import check_logits_processor, check_scheduler

ROOT = pathlib.Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 9, 11, 8000], [7] * 23, list(range(100, 140)), [3, 4]]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints["LlamaForCausalLM"][0])


def make_llm(path, **kw):
    base = dict(max_model_len=64, num_kv_blocks=48, block_size=4, progress=False)
    return LLM(path, **{**base, **kw})


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny):
    """Each prompt run alone on the default parts: what every combination must say."""
    llm = make_llm(tiny)
    return [llm.generate([{"prompt_token_ids": p}], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]


def prompts():
    return [{"prompt_token_ids": p} for p in PROMPTS]


# --- the step is plain data -------------------------------------------------------

def test_runner_fed_only_a_msgspec_copy_of_each_step_says_the_same(tiny, reference):
    llm = make_llm(tiny, num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=3)   # chunks, preemption
    runner = llm.engine.runner
    execute = runner.execute
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(SchedulerOutput)
    seen = []

    def execute_copy(sched):
        copy = decoder.decode(encoder.encode(sched))
        assert copy == sched
        seen.append(copy)
        return execute(copy)
    runner.execute = execute_copy
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert any(s.preempted_req_ids for s in seen) and any(s.cached_requests for s in seen)
    assert all(isinstance(d.block_ids, list) for s in seen for d in s.new_requests)
    # the recompute tax, recounted from the steps: tokens computed below a request's high-water mark
    high, recomputed, computed = {}, 0, 0
    for s in seen:
        ctx = {d.request_id: d.num_computed_tokens for d in [*s.new_requests, *s.cached_requests]}
        for rid, n in s.num_scheduled_tokens.items():
            recomputed += max(0, min(high.get(rid, 0), ctx[rid] + n) - ctx[rid])
            high[rid] = max(high.get(rid, 0), ctx[rid] + n)
            computed += n
    eng = llm.engine
    assert recomputed > 0 and (eng.num_recomputed_tokens, eng.num_computed_tokens) == (recomputed, computed)
    assert eng.last_stats.recompute_tax == pytest.approx(recomputed / computed)


def test_core_imports_no_plugin_and_nothing_device_specific():
    bad = []
    for path in (ROOT / "core").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names
                    if n.startswith(("fdx.plugins", "fdx.ops"))]
    assert not bad, bad


# --- backends choose -------------------------------------------------------------------

def test_cpu_backend_uses_the_compiled_kernel_and_rejects_other_dtypes(tiny, reference, monkeypatch):
    from fdx.ops import cpp
    llm = make_llm(tiny)
    assert llm.engine.attention.name == "cpu"
    passed = llm.engine.backend.kernels.usable("cpp.paged_attention")
    assert passed == cpp.available()                 # the compiled attention passes its probe wherever it builds
    calls = []
    # the compiled attention runs as its own op in a composed layer, or inside the one
    # compiled call for a layer or for all of them (steps under the float32 build's
    # f32_blas_min_rows: with AVX2's 256, every step of this test)
    for name in ("paged_attention", "decoder_layer", "decoder_stack"):
        real = getattr(cpp, name)
        monkeypatch.setattr(cpp, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert bool(calls) == passed
    with pytest.raises(ConfigError, match="model.dtype.*cpu backend computes in float32, not bfloat16"):
        make_llm(tiny, dtype="bfloat16")


@functools.cache
def cpu_kernel_table():
    """The cpu backend's kernel table for this host (probed in a child
    process once, then cached)."""
    from fdx.plugins.backends.cpu import probe_kernels
    return probe_kernels(1)


def host_runs_fused_rms_norm() -> bool:
    """Whether this CPU runs Paddle's own CPU fused_rms_norm (it dies by
    SIGILL without AVX-512)."""
    return cpu_kernel_table().usable("fused_rms_norm")


class FakeDevice:
    """A test double for Paddle's device layer: a CUDA build with one GPU, or
    the iluvatar_gpu custom device, whose kernels run on the host. Where the
    host's own fused_rms_norm cannot run, the device's is a host double
    (tests/fake_paddle_kernels.py), as on a GPU the device kernel runs."""

    def __init__(self, monkeypatch, kind: str, capability: tuple[int, int] = (8, 0), total: int = 8 << 30):
        import paddle
        self.set_devices = []
        # the allocator's counters, in bytes: tests move them to play a forward's peak
        self.allocated, self.reserved, self.peak = 0, 0, 0
        props = lambda *a: type("P", (), {"total_memory": total})()   # noqa: E731
        stats = dict(memory_allocated=lambda *a: self.allocated, memory_reserved=lambda *a: self.reserved,
                     max_memory_allocated=lambda *a: max(self.peak, self.allocated),
                     max_memory_reserved=lambda *a: self.reserved,
                     reset_max_memory_allocated=lambda *a: setattr(self, "peak", self.allocated),
                     synchronize=lambda *a: None, get_device_properties=props)
        if kind == "cuda":
            cuda = paddle.device.cuda
            monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
            monkeypatch.setattr(cuda, "device_count", lambda: 1, raising=False)
            monkeypatch.setattr(cuda, "get_device_name", lambda i=0: "Fake GPU", raising=False)
            monkeypatch.setattr(cuda, "get_device_capability", lambda i=0: capability, raising=False)
            for name, fn in stats.items():
                monkeypatch.setattr(cuda, name, fn, raising=False)
        else:
            monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: False)
            monkeypatch.setattr(paddle.device, "get_all_custom_device_type", lambda: ["iluvatar_gpu"], raising=False)
            for name, fn in stats.items():
                monkeypatch.setattr(paddle.device, name, fn, raising=False)
        real = paddle.set_device
        monkeypatch.setattr(paddle, "set_device", lambda d: (self.set_devices.append(d), real("cpu"))[1])
        if not host_runs_fused_rms_norm():
            import paddle.incubate.nn.functional as IF
            from fake_paddle_kernels import FakeFusedRmsNorm
            monkeypatch.setattr(IF, "fused_rms_norm", FakeFusedRmsNorm())


@pytest.mark.parametrize("kind,device", [("cuda", "gpu:0"), ("iluvatar", "iluvatar_gpu:0")])
def test_gpu_backends_never_choose_the_cpu_kernel(tiny, reference, monkeypatch, kind, device):
    from fdx.ops import cpp
    fake = FakeDevice(monkeypatch, kind, capability=(7, 5))     # a Turing GPU: no bfloat16
    calls = []
    real_kernel = cpp.paged_attention
    monkeypatch.setattr(cpp, "paged_attention", lambda *a, **k: (calls.append(1), real_kernel(*a, **k))[1])
    llm = make_llm(tiny, dtype="float32")     # the host runs the fake device's kernels: no half matmul
    eng = llm.engine
    assert eng.backend.name == kind and fake.set_devices == [device]      # auto picked the fake device
    assert eng.attention.name == "paddle" and eng.attention.impl == "paddle"
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert not calls, "the compiled CPU kernel ran on a GPU backend"
    with pytest.raises(ConfigError, match=f"model.dtype.*{kind} backend computes in float16, float32, "
                                          "not bfloat16"):
        make_llm(tiny, dtype="bfloat16")


# --- the third-party plugins, selected by config ----------------------------------------

@pytest.fixture(scope="module")
def ex(example_plugin_installed):
    import fdx_example_plugin
    return fdx_example_plugin


@pytest.fixture(scope="module")
def pm(example_plugin_installed):
    return PluginManager()


def test_outside_scheduler_queue_order_and_victim_keep_outputs(tiny, reference, ex, pm):
    """The outside scheduler policy runs on the engine's scheduling core;
    its setting (a cap on each new prompt's first chunk) shapes the steps."""
    llm = make_llm(tiny, plugins=pm, kv_scheduler="example-fifo", policy="shortest-first",
                   preemption="most-output", num_kv_blocks=16, max_num_batched_tokens=16, max_num_seqs=3,
                   **{"plugins.kv_scheduler.example-fifo": {"max_first_chunk": 5}})
    eng = llm.engine
    assert type(eng.scheduling.policy).__name__ == "FifoScheduler"
    assert eng.resource_manager is eng.scheduling                  # the old name, an alias
    firsts = []
    real = eng.scheduling.schedule

    def schedule():
        out = real()
        firsts.extend(out.num_scheduled_tokens[d.request_id] for d in out.new_requests)
        return out
    eng.scheduling.schedule = schedule
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert firsts and max(firsts) <= 5
    with pytest.raises(ConfigError, match="plugins.kv_scheduler.example-fifo.*max_first_chunk"):
        make_llm(tiny, plugins=pm, resource_manager="example-fifo",              # the old names, aliases
                 **{"plugins.resource_manager.example-fifo": {"max_first_chunk": 0}})


def test_outside_kv_cache_and_fake_device_backend(tiny, reference, ex, pm, monkeypatch):
    import paddle.nn.functional as F
    llm = make_llm(tiny, plugins=pm, kv_cache="example-blocks", backend="fakedev")
    assert llm.engine.attention.name == "example-naive" and llm.engine.backend.name == "fakedev"
    assert llm.engine.backend.kernels.findings == {"swiglu": None}        # the outside backend's own probe
    calls, swiglu = len(ex.ROPE_CALLS), []
    real = F.swiglu
    monkeypatch.setattr(F, "swiglu", lambda *a, **k: (swiglu.append(1), real(*a, **k))[1])
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert swiglu                                      # its table passed swiglu: the MLPs ran it
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    assert len(ex.ROPE_CALLS) > calls                  # the outside fused step ran, every layer


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Ernie4_5ForCausalLM"])
def test_outside_rope_write_kv_with_qk_norm_and_interleaved_rotary(tiny_checkpoints, arch, ex, pm):
    """The outside attention's rope_write_kv, written from the contract's
    words only, on per-head q/k norm (Qwen3) and pair rotation (ERNIE):
    the same tokens as the built-in cpu backend."""
    path = str(tiny_checkpoints[arch][0])
    want = token_ids(make_llm(path).generate(prompts(), GREEDY))
    calls = len(ex.ROPE_CALLS)
    assert token_ids(make_llm(path, plugins=pm, backend="fakedev").generate(prompts(), GREEDY)) == want
    assert len(ex.ROPE_CALLS) > calls


def test_outside_connector_loads_what_it_saved(tiny, reference, pm):
    llm = make_llm(tiny, plugins=pm, kv_connector="example-memory")
    first = token_ids(llm.generate(prompts(), GREEDY))
    again = token_ids(llm.generate(prompts(), GREEDY))
    assert first == again == reference
    stats = llm.engine.connector.stats()
    assert stats["loaded_blocks"] >= sum((len(p) - 1) // 4 for p in PROMPTS), stats
    assert stats["queued_requests"] == 2 * len(PROMPTS), stats      # KVConnector.request_added, from outside


def test_a_request_the_connector_fails_is_reported_finished(tiny):
    """A connector's take_failed ends a request inside the scheduling core
    (its KV never came): the request comes back aborted with the reason,
    and observers hear fdx_request_finished for it, as for any abort."""
    from fdx.core.hookspecs import hookimpl
    from fdx.core.interfaces import KVConnector

    class NeverArrives(KVConnector):
        """Every request's KV "comes from elsewhere" and never does."""
        def __init__(self, settings, context):
            super().__init__(settings, context)
            self.deferred: set[str] = set()

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0

        def update_state_after_alloc(self, request, block_ids, num_external_tokens):
            pass

        def build_connector_meta(self):
            return None

        def start_load_kv(self, metadata):
            pass

        def defer_request(self, request):
            self.deferred.add(request.request_id)
            return True

        def take_failed(self):
            out, self.deferred = {rid: "the KV never came" for rid in self.deferred}, set()
            return out

    finished = []

    class Plugin:
        @hookimpl
        def fdx_register_connectors(self, register):
            register("never-arrives", NeverArrives)

        @hookimpl
        def fdx_request_finished(self, request, output):
            finished.append((request.request_id, output.outputs[0].finish_reason))

    pm = PluginManager()
    pm.add_plugin(Plugin(), name="never-arrives")
    llm = make_llm(tiny, plugins=pm, kv_connector="never-arrives")
    outs = llm.generate(prompts()[:2], GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort"]
    assert sorted(finished) == sorted((o.request_id, "abort") for o in outs)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


def _layer_groups(calls):
    """LAYER_CALLS cut at each step's ("start", n): [(n, the calls of that step's forward)]."""
    groups = []
    for c in calls:
        if c[0] == "start":
            groups.append((c[1], []))
        else:
            groups[-1][1].append(c)
    return groups


@pytest.mark.parametrize("which", ["built-in decoder", "outside model"])
def test_outside_connector_sees_the_per_layer_hooks_in_order(which, tiny, tiny_checkpoints, reference, ex, pm,
                                                            tmp_path):
    """wait_for_layer_load(i) and save_kv_layer(i, that layer's KV, meta), once per decoder
    layer of each forward, in layer order, after the step's start_load_kv, through LLM; the
    outside model (tests/plugin_pkg, the same weights) calls them as the contract says."""
    import json
    path = tiny if which == "built-in decoder" else _as_arch(tiny_checkpoints, tmp_path, "ExampleLlamaForCausalLM")
    want = reference
    num_layers = json.loads((pathlib.Path(path) / "config.json").read_text())["num_hidden_layers"]
    assert num_layers > 1
    ex.LAYER_CALLS.clear()
    llm = make_llm(path, plugins=pm, kv_connector="example-layer-recorder")
    assert ex.LAYER_CALLS == [("register", num_layers)]
    ex.LAYER_CALLS.clear()
    got = token_ids(llm.generate(prompts(), GREEDY))
    assert got == want                                      # hooks that do nothing change nothing
    groups = _layer_groups(ex.LAYER_CALLS)
    steps = [n for n, _ in groups]
    assert steps == list(range(steps[0], steps[0] + len(steps)))     # every step, in order
    one_forward = [c for i in range(num_layers) for c in (("wait", i), ("save", i, True))]
    forwards = [calls for _, calls in groups if calls]
    assert all(calls == one_forward for _, calls in groups if calls), groups[:3]
    assert len(forwards) >= max(len(t) for t in got)       # a prefill, then a forward per decode step


def test_outside_admission_rule_caps_a_tenant_with_settings(tiny, ex, pm):
    llm = make_llm(tiny, plugins=pm, admission=["tenant-cap"],
                   **{"plugins.admission_rule.tenant-cap": {"max_running": 1}})
    sp = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, extra_args={"tenant": t})
          for t in ("a", "a", "b", "a")]
    from fdx.core.hookspecs import hookimpl
    from fdx.core.request import RequestStatus
    running_by_step = []

    class Watch:
        @hookimpl
        def fdx_step_finished(self, context):
            running_by_step.append([r.sampling_params.extra_args["tenant"]
                                    for r in context.engine.resource_manager.requests()
                                    if r.status is RequestStatus.RUNNING])
    pm.add_plugin(Watch(), name="tenant-watch")
    try:
        outs = llm.generate(prompts(), sp)
    finally:
        pm.pm.unregister(name="tenant-watch")
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert all(t.count("a") <= 1 for t in running_by_step) and any(len(t) == 2 for t in running_by_step)
    two = make_llm(tiny, plugins=pm, admission=["tenant-cap"],        # the value set reaches the rule
                   **{"plugins.admission_rule.tenant-cap": {"max_running": 2}})
    from fdx.core.guided import GuidedAdmission        # the guided rule is always on (decoding.guided_backend auto)
    assert [r.max_running for r in two.engine.resource_manager.ext.admission_rules
            if not isinstance(r, GuidedAdmission)] == [2]
    # its Settings schema, validated by the engine: errors name the full key (even when not selected)
    for value, why in ((0, "greater than or equal to 1"), ("two", "valid integer")):
        with pytest.raises(ConfigError, match=rf"config key 'plugins\.admission_rule\.tenant-cap\.max_running'"
                                              rf": Input should be (a )?{why}"):
            make_llm(tiny, plugins=pm, admission=["tenant-cap"],
                     **{"plugins.admission_rule.tenant-cap": {"max_running": value}})
    with pytest.raises(ConfigError, match=r"unknown config key 'plugins\.admission_rule\.tenant-cap\.max_runing'"):
        make_llm(tiny, plugins=pm, **{"plugins.admission_rule.tenant-cap.max_runing": 2})
    with pytest.raises(ConfigError, match=r"plugins.admission_rule.nope.*no admission_rule named 'nope'"):
        make_llm(tiny, plugins=pm, **{"plugins.admission_rule.nope": {"x": 1}})


def first_repeat_cut(ids: list[int], n: int) -> tuple[list[int], bool]:
    """Brute force: ``ids`` up to the first ``n`` equal tokens in a row, and whether there were any."""
    for k in range(n, len(ids) + 1):
        if len(set(ids[k - n:k])) == 1:
            return ids[:k], True
    return ids, False


def test_outside_token_processor_sampler_and_runner(tiny, ex, pm):
    """example-no-repeat (token processor), example-argmax (sampler, named by
    the fakedev-argmax backend) and example-counting (model runner), selected
    by config: the default parts' greedy tokens, cut where a brute-force scan
    finds two equal tokens in a row ("stop", "repeat"); the default sampler's
    logprobs; the runner was given every token the engine computed, and
    closed with it."""
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    ref = make_llm(tiny).generate(prompts(), sp)
    llm = make_llm(tiny, plugins=pm, backend="fakedev-argmax", model_runner="example-counting",
                   token_processor="example-no-repeat",
                   **{"plugins.token_processor.example-no-repeat": {"max_repeats": 2}})
    eng = llm.engine
    assert [type(p) for p in (eng.sampler, eng.runner, eng.token_processor)] == \
        [pm.get("sampler", "example-argmax"), pm.get("model_runner", "example-counting"),
         pm.get("token_processor", "example-no-repeat")]
    cuts = 0
    for got, want in zip(llm.generate(prompts(), sp), ref):
        got, want = got.outputs[0], want.outputs[0]
        ids, cut = first_repeat_cut(want.token_ids, 2)
        cuts += cut
        assert got.token_ids == ids
        assert (got.finish_reason, got.stop_reason) == (("stop", "repeat") if cut else ("length", None))
        for mine, theirs in zip(got.logprobs, want.logprobs):
            assert {t: lp.rank for t, lp in mine.items()} == {t: lp.rank for t, lp in theirs.items()}
            assert all(lp.logprob == pytest.approx(theirs[t].logprob, abs=1e-4) for t, lp in mine.items())
    assert cuts                                        # the rule ended at least one request
    assert eng.runner.num_tokens == eng.num_computed_tokens > 0
    with pytest.raises(ConfigError, match="plugins.token_processor.example-no-repeat.max_repeats"):
        make_llm(tiny, plugins=pm, token_processor="example-no-repeat",
                 **{"plugins.token_processor.example-no-repeat": {"max_repeats": 1}})
    llm.close()
    assert eng.runner.closed


def test_every_kind_the_engine_builds_goes_through_make_plugin(tiny, ex, pm, caplog, tmp_path):
    """Issue 36 item 2: one constructor path. Outside plugins of every kind an
    engine builds, selected by config, end to end through LLM: each is
    constructed by ``fdx.core.plugins.make_plugin`` (its log line names kind,
    name and class; so are the built-in parts), every one of them in the
    ``(settings, context)`` shape but example-fifo, the package's one
    older-shape class, which goes through the adapter with the only
    DeprecationWarning; every selected part is the outside class."""
    import logging
    caplog.set_level(logging.DEBUG, logger="fdx.plugins")
    selected = {"backend": "fakedev", "attention_backend": "example-naive", "weight_format": "example-int8",
                "kv_cache": "example-blocks", "kv_scheduler": "example-fifo", "queue_policy": "shortest-first",
                "admission_rule": "tenant-cap", "preemption_policy": "most-output",
                "token_processor": "example-no-repeat", "logits_processor": "stop-after",
                "observer": "example-recorder", "proposer": "example-lookback"}
    with pytest.warns(DeprecationWarning, match=r"kv_scheduler 'example-fifo' .*older per-kind shape") as warned:
        llm = make_llm(tiny, plugins=pm, backend="fakedev", quantization="example-int8", kv_cache="example-blocks",
                       kv_scheduler="example-fifo", policy="shortest-first", admission=["tenant-cap"],
                       preemption="most-output", token_processor="example-no-repeat",
                       logits_processors=["stop-after"], observers=["example-recorder"],
                       speculative_config={"method": "example-lookback", "num_speculative_tokens": 2},
                       **{"plugins.observer.example-recorder": {"path": str(tmp_path / "records.jsonl")}})
    assert {str(w.message).split("'")[1] for w in warned if "older per-kind shape" in str(w.message)} == {"example-fifo"}
    outs = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert all(o.outputs[0].token_ids for o in outs)
    built = {(r.args[0], r.args[1]): r.args[2] + "." + r.args[3] for r in caplog.records
             if r.name == "fdx.plugins" and r.msg.startswith("built ")}
    for kind, name in selected.items():
        cls = pm.get(kind, name)
        assert built.get((kind, name)) == f"{cls.__module__}.{cls.__qualname__}", (kind, name)
    # the built-in parts this engine chose went the same way
    assert {"sampler", "model_runner", "model"} <= {kind for kind, _ in built}
    eng = llm.engine
    assert type(eng.backend).__name__ == "FakeDevice" and type(eng.speculation.proposer).__name__ == "LookbackProposer"
    assert (tmp_path / "records.jsonl").read_text().count('"finished"') == len(PROMPTS)
    llm.close()


def _built_classes(caplog) -> dict[tuple[str, str], type]:
    """(kind, name) -> the class ``make_plugin`` logged building."""
    import importlib
    built = {}
    for r in caplog.records:
        if r.name == "fdx.plugins" and r.msg.startswith("built "):
            kind, name, module, qualname = r.args
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            built[(kind, name)] = obj
    return built


def test_every_builtin_part_is_built_in_the_one_shape_without_the_adapter(tiny, caplog):
    """Issue 36 item 2: an LLM run on the default parts, and one on the
    other built-in scheduling, cache, connector and proposer choices, with
    DeprecationWarning an error (the adapter for older shapes warns, for a
    built-in too): every part of every kind the engine builds, the executor
    and the model included, is an fdx class constructed as
    ``cls(settings, context)``, and the runs answer as the default parts
    alone do."""
    import logging
    import warnings

    from fdx.core.plugins import new_shape
    caplog.set_level(logging.DEBUG, logger="fdx.plugins")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    others = dict(kv_scheduler="v0", kv_cache="prefix", policy="priority", preemption="least-computed",
                  kv_connector="swap", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    runs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for kw in ({}, others):
            caplog.clear()
            llm = make_llm(tiny, **kw)
            runs.append(token_ids(llm.generate(prompts(), sp)))
            llm.close()
            built = _built_classes(caplog)
            kinds = {kind for kind, _ in built}
            assert {"backend", "attention_backend", "sampler", "model_runner", "model", "weight_format",
                    "kv_cache", "kv_scheduler", "queue_policy", "preemption_policy", "token_processor",
                    "logits_processor"} <= kinds, kinds
            if kw:
                assert {"connector", "proposer"} <= kinds and ("kv_scheduler", "v0") in built
            for (kind, name), cls in built.items():
                assert cls.__module__.startswith("fdx.") and new_shape(cls), (kind, name, cls)
    assert runs[0] == runs[1]


def test_outside_activation_function_equals_a_transformers_hook(tiny_checkpoints, pm):
    from test_llm import hf_greedy
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    llm = make_llm(str(path), plugins=pm)
    acts = {"add": [{"point": "mlp_out", "layer": 1, "function": "example-scale", "args": {"factor": -1.5}}]}
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, activations=acts)
    got = llm.generate([{"prompt_token_ids": PROMPTS[0]}], sp)[0].outputs[0].token_ids
    handle = hf.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * -1.5)
    try:
        assert got == hf_greedy(hf, PROMPTS[0], 6, follow=got)
    finally:
        handle.remove()


@pytest.mark.slow
def test_outside_request_scheduler_serves_through_a_real_server(tmp_path, tiny_model, example_plugin_installed):
    """scheduler.request_scheduler example-tally: the server's requests go
    through it (its counter on /metrics) and are answered."""
    import openai

    from serve_utils import API_KEY, ready_server
    srv = ready_server(tmp_path, model={"model": tiny_model, "max_model_len": 256},
                       scheduler={"request_scheduler": "example-tally"})
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
        model = client.models.list().data[0].id
        resp = client.completions.create(model=model, prompt="Hello there", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 4
        m = srv.metrics()
        assert m['example_tally_requests_total{event="added"}'] == 1
        assert m['example_tally_requests_total{event="finished"}'] == 1
    finally:
        srv.stop()


def test_outside_logits_processor_with_extra_args(tiny, pm):
    llm = make_llm(tiny, plugins=pm, logits_processors=["stop-after"])
    eos = min(llm.tokenizer.eos_token_ids)
    sp = SamplingParams(temperature=0, max_tokens=20, extra_args={"stop_after": 3})
    out = llm.generate(prompts()[:2], sp)
    for o in out:
        assert o.outputs[0].token_ids[3] == eos and len(o.outputs[0].token_ids) == 4
        assert o.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="extra_args.stop_after must be a non-negative integer"):
        llm.generate(prompts()[:1], SamplingParams(extra_args={"stop_after": "x"}))


def test_observer_sees_step_context_before_update(tiny, ex, pm):
    llm = make_llm(tiny, plugins=pm, max_num_batched_tokens=16)
    start = len(ex.CONTEXTS)
    outs = llm.generate(prompts(), GREEDY)
    seen = ex.CONTEXTS[start:]
    assert sum(p for _, p, _, _ in seen) == sum(len(p) for p in PROMPTS)       # every prompt token once
    assert sum(d for _, _, d, _ in seen) == sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    assert all(used > 0 for *_, used in seen)


def test_a_raising_observer_does_not_stop_the_others(tiny):
    from fdx.core.hookspecs import hookimpl
    calls = []

    class Bad:
        @hookimpl
        def fdx_step_finished(self, step_stats):
            raise RuntimeError("boom")

    class Good:
        @hookimpl
        def fdx_step_finished(self, step_stats):
            calls.append(step_stats.step)
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Good(), name="good")
    pm.add_plugin(Bad(), name="bad")            # pluggy calls the last registered first
    llm = make_llm(tiny, plugins=pm)
    llm.generate(prompts()[:1], SamplingParams(max_tokens=3))
    assert calls and calls == list(range(1, len(calls) + 1))


# pairwise over (scheduler, cache, queue order, victim), the outside plugins included
PAIRWISE = [("v1", "paged", "fcfs", "newest"), ("v1", "prefix", "priority", "least-computed"),
            ("v1", "example-blocks", "lpm", "most-output"), ("v1", "prefix", "shortest-first", "newest"),
            ("v0", "prefix", "fcfs", "newest"), ("v0", "paged", "lpm", "newest"),
            ("v0", "example-blocks", "shortest-first", "newest"), ("v0", "prefix", "priority", "newest"),
            ("example-fifo", "prefix", "fcfs", "most-output"), ("example-fifo", "paged", "priority", "newest"),
            ("example-fifo", "example-blocks", "lpm", "least-computed"),
            ("example-fifo", "prefix", "shortest-first", "least-computed")]


@pytest.mark.slow
def test_greedy_outputs_unchanged_pairwise(tiny, reference, pm):
    """A small pool and step budget (chunked prefill and preemption forced)
    on every pair of (scheduler, cache, order, victim) values."""
    for rm, cache, policy, victim in PAIRWISE:
        llm = make_llm(tiny, plugins=pm, resource_manager=rm, kv_cache=cache, policy=policy, preemption=victim,
                       num_kv_blocks=20, max_num_batched_tokens=12, max_num_seqs=3)
        assert token_ids(llm.generate(prompts(), GREEDY)) == reference, (rm, cache, policy, victim)
        kv = llm.engine.kv_cache
        assert kv.num_free_blocks == kv.num_blocks, (rm, cache, policy, victim)


def test_every_registered_scheduler_and_extension_keeps_the_rules(ex):
    """The conformance kit over every name registered for each kind, the
    outside package's included (each value at least once, pairwise-light)."""
    pm = get_plugin_manager()
    for name in pm.names("resource_manager"):
        check_scheduler(name, "prefix", max_examples=8)
    for name in pm.names("kv_cache"):
        check_scheduler("v1", name, max_examples=8)
    for name in pm.names("queue_policy"):
        check_scheduler("v1", "prefix", name, max_examples=8)
    for name in pm.names("preemption_policy"):
        check_scheduler("v1", "paged", preemption=name, max_examples=8)
    for name in pm.names("admission_rule"):
        check_scheduler("v1", "paged", admission=[name], max_examples=8)


def test_a_policy_sees_only_the_documented_view_of_the_scheduling_core():
    """schedule(core) is handed a SchedulingView: every name docs/plugins.md
    lists works, and reaching past it (the core's own bookkeeping, a list to
    rewrite) is an AttributeError naming the view, in the conformance kit
    as in the engine; v0 runs on the view alone."""
    from fdx.core.hookspecs import hookimpl
    from fdx.core.interfaces import SchedulerPolicy
    from fdx.core.scheduling import SchedulingView
    doc = (ROOT / "docs" / "plugins.md").read_text()
    section = doc[doc.index("### A KV scheduler"):doc.index("```python", doc.index("### A KV scheduler"))]
    listed = set(re.findall(r"`core\.([a-z_]+)", section))
    surface = {n for n, v in vars(SchedulingView).items() if not n.startswith("_")}
    assert listed == surface, (listed ^ surface)
    seen = {}

    class Reaching(SchedulerPolicy):
        def schedule(self, core):
            for name in ("recving", "held", "out", "policy"):
                try:
                    getattr(core, name)
                    seen[name] = "reached"
                except AttributeError as e:
                    seen[name] = str(e)
            seen["lists"] = (type(core.running), type(core.waiting), type(core.loading))
            core.schedule_running()
            core.admit_waiting()

    class Plugin:
        @hookimpl
        def fdx_register_kv_schedulers(self, register):
            register("kit-reaching", Reaching)

    pm = PluginManager()
    pm.add_plugin(Plugin(), name="kit-reaching")
    check_scheduler("kit-reaching", "paged", max_examples=2, plugin_manager=pm)
    assert seen["lists"] == (tuple, tuple, tuple)
    for name in ("recving", "held", "out", "policy"):
        assert "SchedulingView" in seen[name], (name, seen[name])
    check_scheduler("v0", "prefix", max_examples=8)


def test_conformance_kit_on_the_outside_plugins(ex):
    check_scheduler("example-fifo", "example-blocks", "shortest-first", preemption="most-output",
                    max_examples=25)
    check_scheduler("v1", "prefix", "fcfs", admission=["tenant-cap"], max_examples=15)
    check_logits_processor("stop-after", [SamplingParams(extra_args={"stop_after": 1}), SamplingParams(),
                                          SamplingParams(extra_args={"stop_after": 2})])


@pytest.mark.parametrize("name,params", [
    ("penalties", [SamplingParams(repetition_penalty=1.3), SamplingParams(),
                   SamplingParams(presence_penalty=0.5, frequency_penalty=0.3)]),
    ("min_tokens", [SamplingParams(min_tokens=2), SamplingParams(min_tokens=5, ignore_eos=True)]),
    ("logit_bias", [SamplingParams(logit_bias={3: 5.0, 7: -100}), SamplingParams()]),
    ("allowed_token_ids", [SamplingParams(allowed_token_ids=[1, 2, 9]), SamplingParams()]),
    ("bad_words", [SamplingParams(bad_words=["ab", "c"]), SamplingParams()]),
])
def test_conformance_kit_on_the_builtin_processors(name, params):
    check_logits_processor(name, params)


# --- built-in processors against numpy ------------------------------------------------

def test_logit_bias_allowed_ids_and_bad_words_against_numpy(tiny):
    llm = make_llm(tiny)
    vocab = llm.engine.model.vocab_size
    ids = PROMPTS[0]
    base = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5))[0]
    first = base.outputs[0].token_ids[0]
    runner_up = [t for t in base.outputs[0].logprobs[0] if t != first][0]
    # +100 on the runner-up makes it the argmax; -100 on the argmax removes it
    biased = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=1, logit_bias={str(runner_up): 100}))[0].outputs[0].token_ids
    assert biased == [runner_up]
    allowed = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=[11, 12, 13]))[0]
    assert set(allowed.outputs[0].token_ids) <= {11, 12, 13}
    word = llm.tokenizer.decode([first])
    banned = llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=1, bad_words=[word.strip() or word]))[0].outputs[0].token_ids
    assert banned != [first]
    with pytest.raises(ValueError, match="allowed_token_ids.*below the vocabulary size"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[vocab]))


# --- research taps ------------------------------------------------------------------------

@pytest.mark.slow
def test_prompt_logprobs_match_transformers(smollm_llm, hf_logits):
    ids = smollm_llm.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    out = smollm_llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ref = hf_logits(ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for i in range(1, len(ids)):
        entry = out.prompt_logprobs[i]
        assert entry[ids[i]].logprob == pytest.approx(ref[i - 1, ids[i]], abs=2e-3)
        top = sorted(entry.values(), key=lambda t: t.rank)
        assert top[0].token_id == int(np.argmax(ref[i - 1]))


def test_logits_and_hidden_state_taps(tiny, pm):
    from fdx.core.hookspecs import hookimpl
    seen = []

    class Tap:
        @hookimpl
        def fdx_step_finished(self, context):
            seen.append((context.sampled_request_ids, context.logits, context.hidden_states))
    pm2 = PluginManager(load_entry_points=False)
    pm2.add_plugin(Tap(), name="tap")
    llm = make_llm(tiny, plugins=pm2, capture_logits=True, capture_hidden_states=True)
    out = llm.generate(prompts()[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    firsts = [s for s in seen if s[0]]
    rows, logits, hidden = firsts[0]
    assert logits.shape == (len(rows), llm.engine.model.vocab_size) and hidden.shape[0] == len(rows)
    # greedy: the tapped logits' argmax is the token sampled
    assert [int(t) for t in logits.argmax(axis=1)] == [o.outputs[0].token_ids[0] for o in out][:len(rows)]


# --- the model contract, from outside ------------------------------------------------------

def _as_arch(tiny_checkpoints, tmp_path, arch: str) -> str:
    """The tiny Llama checkpoint with config.json's architecture renamed."""
    import json
    import shutil
    src = tiny_checkpoints["LlamaForCausalLM"][0]
    dst = tmp_path / arch
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def test_outside_model_matches_transformers_with_its_hidden_state_tap(tiny_checkpoints, tmp_path, ex):
    """ExampleLlamaForCausalLM (tests/plugin_pkg, the Model contract only):
    greedy tokens equal transformers' Llama on the same weights, through
    chunked prefill and preemption, and the hidden-state tap holds
    transformers' final hidden states."""
    import torch
    from fdx.core.hookspecs import hookimpl
    path = _as_arch(tiny_checkpoints, tmp_path, "ExampleLlamaForCausalLM")
    hf = tiny_checkpoints["LlamaForCausalLM"][1]
    seen = []

    class Tap:
        @hookimpl
        def fdx_step_finished(self, context):
            if context.hidden_states is not None:
                seen.append((list(context.sampled_request_ids), context.hidden_states))
    tapped = PluginManager()                     # the entry points (the outside model) and the tap
    tapped.add_plugin(Tap(), name="model-tap")
    llm = make_llm(path, plugins=tapped, capture_hidden_states=True, num_kv_blocks=16,
                   max_num_batched_tokens=16, max_num_seqs=3)
    assert type(llm.engine.model).__name__ == "ExampleLlamaForCausalLM"
    outs = llm.generate(prompts(), GREEDY)
    for p, out in zip(PROMPTS, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                               eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out.outputs[0].token_ids == want
    # a prompt's first sampled row: transformers' last hidden state (after the final norm) at its end
    first_rows = {}
    for rids, hidden in seen:
        for r, rid in enumerate(rids):
            first_rows.setdefault(rid, hidden[r])
    by_id = {o.request_id: p for o, p in zip(outs, PROMPTS)}
    assert set(by_id) <= set(first_rows)
    for rid, p in by_id.items():
        with torch.no_grad():
            ref = hf(torch.tensor([p]), output_hidden_states=True).hidden_states[-1][0, -1].numpy()
        np.testing.assert_allclose(first_rows[rid], ref, rtol=1e-4, atol=1e-4)


def test_the_engine_refuses_what_an_outside_model_cannot_give(tiny_checkpoints, tmp_path, pm):
    notap = _as_arch(tiny_checkpoints, tmp_path, "ExampleNoTapForCausalLM")
    with pytest.raises(ConfigError, match=r"decoding\.capture_hidden_states.*ExampleNoTapForCausalLM"):
        make_llm(notap, plugins=pm, capture_hidden_states=True)
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size.*cannot be sharded"):
        make_llm(notap, plugins=pm, tensor_parallel_size=2)
    assert token_ids(make_llm(notap, plugins=pm).generate(prompts()[:1], GREEDY))   # runs without the tap
    with pytest.raises(ConfigError, match=r"model\.dtype.*float32 only"):
        from fdx.plugins.backends.gpu import cast_model
        from fdx.model_io.model import load_model
        from fdx.core.config import FdxConfig
        model, _ = load_model(FdxConfig.build(model=notap), pm, progress=False)
        try:
            cast_model(model, "float16")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    bad = _as_arch(tiny_checkpoints, tmp_path, "ExampleNotAModel")
    with pytest.raises(ConfigError, match=r"model\.model.*ExampleNotAModel.*does not subclass "
                                          r"fdx\.core\.interfaces\.Model"):
        make_llm(bad, plugins=pm)


# --- plugin manager --------------------------------------------------------------------------

def test_disabled_plugins_by_entry_point_or_module_name_are_listed(example_plugin_installed):
    for name in ("example", "fdx_example_plugin"):
        pm = PluginManager(disabled=[name])
        assert "example-fifo" not in pm.names("resource_manager")
        assert "disabled by FDX_DISABLED_PLUGINS" in pm.report() and "example" in pm.report()
    assert "example-fifo" in get_plugin_manager().names("resource_manager")
