"""The ``otel`` observer, in process: an ``LLM``'s engine with the SDK's
in-memory exporter. Each request gives a ``fdx.request`` span with
``fdx.queue``, ``fdx.prefill`` and ``fdx.decode`` under it, in the trace of
the ``traceparent`` it came with, timed by the engine's own request times and
counted against the tokens the engine returned (the server end to end is in
tests/test_observability.py)."""
from __future__ import annotations

import secrets

import pytest

from fdx.core.config import ConfigError
from fdx.core.sampling_params import SamplingParams

pytest.importorskip("opentelemetry.sdk")


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


@pytest.fixture(scope="module")
def traced_llm(tiny_model):
    from fdx import LLM
    return LLM(tiny_model, max_model_len=128, num_kv_blocks=8, block_size=16, max_num_seqs=4,
               observers=["otel"], progress=False, **{"plugins.observer.otel": {"exporter": "memory"}})


def run(engine, reqs) -> None:
    for r in reqs:
        engine.add_request(r)
    while engine.has_unfinished():
        engine.step()


def spans_of(observer, engine_request_id: str) -> dict:
    out = {}
    for s in observer.exporter.get_finished_spans():
        if s.attributes.get("fdx.engine_request_id") == engine_request_id:
            assert s.name not in out, f"two {s.name} spans for {engine_request_id}"
            out[s.name] = s
    return out


def test_a_traced_request_gets_queue_prefill_and_decode_spans_under_its_trace(traced_llm):
    engine = traced_llm.engine
    (obs,) = engine.observers
    tp, trace_id, parent_id = traceparent()
    sp = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    reqs = [engine.make_request([5, 6, 7, 8, 9] * (i + 1), sp, request_id=f"xyz-{i}",
                                trace_headers={"traceparent": tp, "x-request-id": "xyz"}) for i in range(2)]
    untraced = engine.make_request([11, 12, 13], sp, request_id="plain-0")
    run(engine, reqs + [untraced])
    for req in reqs:
        spans = spans_of(obs, req.request_id)
        assert set(spans) == {"fdx.request", "fdx.queue", "fdx.prefill", "fdx.decode"}
        root = spans["fdx.request"]
        assert format(root.context.trace_id, "032x") == trace_id          # the incoming trace
        assert format(root.parent.span_id, "016x") == parent_id and root.parent.is_remote
        for name in ("fdx.queue", "fdx.prefill", "fdx.decode"):
            s = spans[name]
            assert s.context.trace_id == root.context.trace_id and s.parent.span_id == root.context.span_id
            assert s.attributes["fdx.request_id"] == "xyz"                # the client's id, on every span
        # timed by the engine's own request times (monotonic -> epoch: one offset for all)
        q, p, d = spans["fdx.queue"], spans["fdx.prefill"], spans["fdx.decode"]
        assert root.start_time == q.start_time <= q.end_time == p.start_time <= p.end_time == d.start_time
        assert d.end_time == root.end_time
        assert abs((p.end_time - p.start_time) / 1e9 - (req.first_token_time - req.first_scheduled_time)) < 1e-6
        assert abs((root.end_time - root.start_time) / 1e9 - (req.finished_time - req.arrival_time)) < 1e-6
        assert root.attributes["gen_ai.usage.input_tokens"] == req.num_prompt_tokens
        assert root.attributes["gen_ai.usage.output_tokens"] == len(req.output_token_ids) == 7
        assert list(root.attributes["gen_ai.response.finish_reasons"]) == ["length"]
        assert p.attributes["fdx.prefill_chunks"] >= 1
    # no traceparent: a trace of its own, and the engine's id stands for the request id
    plain = spans_of(obs, "plain-0")
    assert plain["fdx.request"].parent is None
    assert plain["fdx.request"].attributes["fdx.request_id"] == "plain-0"
    assert format(plain["fdx.request"].context.trace_id, "032x") != trace_id


def test_preemptions_and_aborts_are_traced(traced_llm):
    """8 blocks of 16 tokens: three requests that grow to 60 tokens each
    cannot all stay, so some are preempted (an event per preemption, counted
    on the span as on the request); an aborted request's spans end too."""
    engine = traced_llm.engine
    (obs,) = engine.observers
    sp = SamplingParams(temperature=0.0, max_tokens=44, ignore_eos=True)
    reqs = [engine.make_request(list(range(20 + i, 36 + i)), sp, request_id=f"pre-{i}") for i in range(3)]
    run(engine, reqs)
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted, "the pool was meant to force a preemption"
    for r in reqs:
        root = spans_of(obs, r.request_id)["fdx.request"]
        assert root.attributes["fdx.num_preemptions"] == r.num_preemptions
        assert sum(e.name == "fdx.preempted" for e in root.events) == r.num_preemptions
    gone = engine.make_request([1, 2, 3], sp, request_id="gone-0")
    engine.add_request(gone)
    engine.step()
    engine.abort_request("gone-0")
    spans = spans_of(obs, "gone-0")
    assert list(spans["fdx.request"].attributes["gen_ai.response.finish_reasons"]) == ["abort"]
    assert obs.live == {}                            # nothing left open


def test_bad_otel_settings_are_config_errors_naming_the_key(tiny_model):
    from fdx import LLM
    with pytest.raises(ConfigError, match=r"plugins\.observer\.otel.*exporter"):
        LLM(tiny_model, observers=["otel"], **{"plugins.observer.otel": {"exporter": "carrier-pigeon"}})
    with pytest.raises(ConfigError, match=r"observability\.observers.*no observer named 'nope'"):
        LLM(tiny_model, observers=["nope"])
    with pytest.raises(ConfigError, match=r"plugins\.observer\.otel.*unknown setting 'endpont'"):
        LLM(tiny_model, observers=["otel"], **{"plugins.observer.otel": {"exporter": "memory", "endpont": "x"}})
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401
        has_otlp = True
    except ImportError:
        has_otlp = False
    if not has_otlp:                                   # the extra's exporter is not installed here
        with pytest.raises(ConfigError, match=r"plugins\.observer\.otel.*pip install 'fdx\[otel\]'"):
            LLM(tiny_model, observers=["otel"])


def test_tracing_off_imports_no_opentelemetry(tiny_model):
    """An engine with no observer selected never imports OpenTelemetry (the
    otel plugin module is loaded, as every built-in is, but imports it only
    when built)."""
    import subprocess
    import sys
    code = ("import sys; from fdx import LLM; "
            f"llm = LLM({tiny_model!r}, max_model_len=64, num_kv_blocks=8, progress=False); "
            "llm.generate(['hi']); "
            "assert 'fdx.plugins.observers.otel' in sys.modules; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
