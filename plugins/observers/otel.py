"""``otel``: OpenTelemetry spans for every request an engine runs.

Selected by ``observability.observers: [otel]``; settings under
``plugins.observer.otel`` (docs/observability.md). Per engine request
(one choice of an HTTP request), made in the engine process where the hooks
fire, under the W3C ``traceparent`` the request came with (else a new
trace):

    fdx.request      arrival -> finished (kind SERVER)
      fdx.queue      arrival -> first scheduled
      fdx.prefill    first scheduled -> first token (the prompt computed)
      fdx.decode     first token -> finished

each with ``fdx.request_id`` (the client's X-Request-Id) and
``fdx.engine_request_id``; the request span with the token counts, finish
reason, cached prompt tokens, prefill chunks and preemptions (also an event
each). Nothing of OpenTelemetry is imported unless this observer is
selected: the SDK comes with ``pip install 'fdx[otel]'``.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Observer

EXPORTERS = ("otlp", "console", "memory")
SETTINGS = ("exporter", "endpoint", "headers", "service_name", "file", "timeout_s")


@dataclass(slots=True)
class _Live:
    span: Any                                  # the fdx.request span, open
    request_id: str                            # the client's X-Request-Id (else the engine's id)
    prefill_chunks: int = 0
    preemptions: list[float] = field(default_factory=list)


class OtelObserver(Observer):
    """Spans per request, exported by the SDK's batch (otlp) or simple
    (console, memory) span processor, on a ``TracerProvider`` of its own
    (the process's global one is left alone)."""

    def __init__(self, settings: dict | None = None, context=None):
        super().__init__(settings, context)
        config = self.config
        s = dict(self.settings)
        unknown = sorted(set(s) - set(SETTINGS))
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}; settings: {', '.join(SETTINGS)}")
        kind = s.get("exporter", "otlp")
        if kind not in EXPORTERS:
            raise ValueError(f"exporter must be one of {', '.join(EXPORTERS)}, not {kind!r}")
        try:
            from opentelemetry import trace
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError:
            raise ValueError("the otel observer needs the OpenTelemetry SDK: pip install 'fdx[otel]'") from None
        self._trace = trace
        self.propagator = TraceContextTextMapPropagator()
        self.provider = TracerProvider(resource=Resource.create({
            "service.name": str(s.get("service_name", "fdx")), "fdx.model": str(config.model.model or "default")}))
        self._file = None
        if kind == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            except ImportError:
                raise ValueError("exporter otlp needs opentelemetry-exporter-otlp-proto-http: "
                                 "pip install 'fdx[otel]'") from None
            # endpoint None: the exporter's own default (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
            # http://localhost:4318/v1/traces)
            self.exporter = OTLPSpanExporter(endpoint=s.get("endpoint"), headers=dict(s.get("headers") or {}),
                                             timeout=float(s.get("timeout_s", 10)))
            processor = BatchSpanProcessor(self.exporter)     # exports on its own thread
        elif kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter
            path = s.get("file")
            try:
                self._file = open(path, "a", buffering=1) if path else None
            except OSError as e:
                raise ValueError(f"file: cannot open {path!r}: {e.strerror}") from None
            self.exporter = ConsoleSpanExporter(out=self._file or sys.stderr,
                                                formatter=lambda span: span.to_json(indent=None) + "\n")
            processor = SimpleSpanProcessor(self.exporter)
        else:
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
            self.exporter = InMemorySpanExporter()            # read with .exporter.get_finished_spans()
            processor = SimpleSpanProcessor(self.exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("fdx")
        self.live: dict[str, _Live] = {}
        # the engine's times are on the monotonic clock; spans take epoch nanoseconds
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self.engine_attributes: dict[str, Any] = {}

    def _ns(self, t: float) -> int:
        return int(t * 1e9) + self._offset_ns

    # -- the observer hooks ------------------------------------------------------------
    def fdx_engine_started(self, engine) -> None:
        self.engine_attributes = {"fdx.backend": str(engine.backend.name),
                                  "fdx.max_model_len": int(engine.max_model_len)}

    def fdx_request_added(self, request) -> None:
        headers = request.trace_headers or {}
        parent = self.propagator.extract(carrier=headers)     # an invalid traceparent: a new trace
        rid = headers.get("x-request-id") or request.request_id
        sp = request.sampling_params
        attrs = {"fdx.request_id": rid, "fdx.engine_request_id": request.request_id,
                 "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                 "gen_ai.request.temperature": float(sp.temperature), "gen_ai.request.top_p": float(sp.top_p),
                 **self.engine_attributes}
        if sp.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = int(sp.max_tokens)
        span = self.tracer.start_span("fdx.request", context=parent, kind=self._trace.SpanKind.SERVER,
                                      start_time=self._ns(request.arrival_time), attributes=attrs)
        self.live[request.request_id] = _Live(span, rid)

    def fdx_step_finished(self, scheduler_output, context) -> None:
        live = self.live
        if not live:
            return
        for info in context.requests:
            if info.num_prefill_tokens and info.request_id in live:
                live[info.request_id].prefill_chunks += 1
        now = time.monotonic()
        for rid in scheduler_output.preempted_req_ids:
            entry = live.get(rid)
            if entry is not None:
                entry.preemptions.append(now)
                entry.span.add_event("fdx.preempted", timestamp=self._ns(now))

    def fdx_request_finished(self, request, output) -> None:
        entry = self.live.pop(request.request_id, None)
        if entry is None:
            return
        span, trace = entry.span, self._trace
        done = request.finished_time if request.finished_time is not None else time.monotonic()
        sched, first = request.first_scheduled_time, request.first_token_time
        parent = trace.set_span_in_context(span)
        base = {"fdx.request_id": entry.request_id, "fdx.engine_request_id": request.request_id}

        def child(name: str, start: float, end: float, **attrs) -> None:
            c = self.tracer.start_span(name, context=parent, start_time=self._ns(start),
                                       attributes={**base, **attrs})
            c.end(end_time=self._ns(max(start, end)))

        comp = output.outputs[0] if output is not None and output.outputs else None
        n_out = len(comp.token_ids) if comp is not None else request.num_output_tokens
        reason = comp.finish_reason if comp is not None else request.status.value
        child("fdx.queue", request.arrival_time, sched if sched is not None else done)
        if sched is not None:
            child("fdx.prefill", sched, first if first is not None else done,
                  **{"gen_ai.usage.input_tokens": request.num_prompt_tokens,
                     "fdx.num_cached_tokens": request.num_cached_tokens, "fdx.prefill_chunks": entry.prefill_chunks})
        if first is not None:
            child("fdx.decode", first, done, **{"gen_ai.usage.output_tokens": n_out})
        span.set_attributes({
            "gen_ai.usage.output_tokens": n_out, "gen_ai.response.finish_reasons": [str(reason)],
            "fdx.num_cached_tokens": request.num_cached_tokens, "fdx.prefill_chunks": entry.prefill_chunks,
            "fdx.num_preemptions": request.num_preemptions,
            "fdx.queue_time_s": (sched if sched is not None else done) - request.arrival_time,
            **({"fdx.time_to_first_token_s": first - request.arrival_time} if first is not None else {})})
        if reason == "rejected":
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(request.stop_reason or "rejected")))
        span.end(end_time=self._ns(done))

    def close(self) -> None:
        for entry in self.live.values():           # never finished (the engine stops): ended now
            entry.span.end()
        self.live.clear()
        self.provider.shutdown()                   # flushes the batch processor
        if self._file is not None:
            self._file.close()


@hookimpl
def fdx_register_observers(register):
    register("otel", OtelObserver)
