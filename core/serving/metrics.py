"""Prometheus metrics of ``fdx serve``, all named ``fdx:...`` (see docs/serving.md).

Engine-side gauges come from the stats the engine process sends after each
step; per-request figures are measured in the API process, from the moment
the HTTP request arrived.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()               # no *_created series: they only clutter scrapes
        self.registry = r = CollectorRegistry()
        self.labels = {"model_name": model_name}
        lab = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, lab, registry=r).labels(**self.labels)

        def hist(name, doc, buckets):
            return Histogram(name, doc, lab, buckets=buckets, registry=r).labels(**self.labels)

        self.num_running = gauge("fdx:num_requests_running", "Requests running in the engine (sequences).")
        self.num_waiting = gauge("fdx:num_requests_waiting", "Requests waiting in the engine (sequences).")
        self.kv_usage = gauge("fdx:kv_cache_usage_perc", "KV-cache block usage, 0 to 1.")
        self.kv_free = gauge("fdx:kv_cache_free_blocks", "KV-cache blocks free.")
        self.kv_total = gauge("fdx:kv_cache_total_blocks", "KV-cache blocks in the pool.")
        self.engine_up = gauge("fdx:engine_up", "1 while the engine process runs, 0 once it died.")
        self.api_in_flight = gauge("fdx:api_requests_in_flight", "HTTP generation requests in flight.")
        self.preemptions = Counter("fdx:num_preemptions", "Sequences preempted.", lab, registry=r).labels(**self.labels)
        self.recompute_tax = gauge("fdx:recompute_tax",
                                   "Tokens computed again after a preemption / all tokens computed, since start.")
        self.prompt_tokens = Counter("fdx:prompt_tokens", "Prompt tokens of requests admitted.", lab,
                                     registry=r).labels(**self.labels)
        self.generation_tokens = Counter("fdx:generation_tokens", "Tokens generated.", lab,
                                         registry=r).labels(**self.labels)
        self.request_success = Counter("fdx:request_success", "Finished sequences, by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = hist("fdx:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = hist("fdx:time_per_output_token_seconds",
                         "Mean time per output token after the first, per sequence.", TPOT_BUCKETS)
        self.e2e = hist("fdx:e2e_request_latency_seconds", "End-to-end sequence latency.", LATENCY_BUCKETS)
        self.queue_time = hist("fdx:request_queue_time_seconds", "Time waiting before first scheduled.",
                               LATENCY_BUCKETS)
        self.api_rss = gauge("fdx:api_resident_memory_bytes", "Resident memory of the API server process.")
        self.engine_rss = gauge("fdx:engine_resident_memory_bytes",
                                "Resident memory of the engine process (from its last heartbeat).")
        self.long_step = gauge("fdx:engine_long_step_seconds",
                               "How long the engine step now running has run, once past "
                               "engine_step_timeout_s (0: no step that long).")
        self.long_steps = gauge("fdx:engine_long_steps", "Engine steps that ran past engine_step_timeout_s.")
        self.guided = Gauge("fdx:guided_compiles", "Guided-decoding compiles since the engine started, by "
                            "event (started, cancelled, timed_out, refused).", lab + ["event"], registry=r)
        self._prefix = None                     # created when the KV cache reports prefix counters
        self._splitwise = None                  # created when the splitwise connector reports
        self._prefix_last = (0.0, 0.0)

    def observe_engine(self, stats) -> None:
        """An ``EngineStats`` from the engine process."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_free.set(stats.num_free_blocks)
        self.kv_total.set(stats.num_blocks)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.num_computed_tokens:
            self.recompute_tax.set(stats.num_recomputed_tokens / stats.num_computed_tokens)
        cs = stats.cache_stats
        for key, value in cs.items():
            if key.startswith("guided_compiles_"):
                self.guided.labels(**self.labels, event=key[len("guided_compiles_"):]).set(value)
        if "prefix_cache_queries" in cs and "prefix_cache_hits" in cs:
            self._observe_prefix(cs["prefix_cache_queries"], cs["prefix_cache_hits"])
        if "splitwise_transfers_failed" in cs:
            if self._splitwise is None:
                self._splitwise = SplitwiseCollector(self.labels)
                self.registry.register(self._splitwise)
            self._splitwise.stats = dict(cs)

    def _observe_prefix(self, queries: float, hits: float) -> None:
        if self._prefix is None:
            r, lab = self.registry, ["model_name"]
            self._prefix = (
                Counter("fdx:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", lab,
                        registry=r).labels(**self.labels),
                Counter("fdx:prefix_cache_hits", "Prompt tokens served by the prefix cache.", lab,
                        registry=r).labels(**self.labels),
                Gauge("fdx:prefix_cache_hit_rate", "Prefix-cache hits / queries since start, 0 to 1.", lab,
                      registry=r).labels(**self.labels))
        q0, h0 = self._prefix_last
        self._prefix[0].inc(max(0.0, queries - q0))
        self._prefix[1].inc(max(0.0, hits - h0))
        self._prefix_last = (queries, hits)
        self._prefix[2].set(hits / queries if queries else 0.0)

    def observe_engine_process(self, engine) -> None:
        """From the ``EngineClient``: memory (its last heartbeat's, and this
        process's) and a step running past its timeout."""
        self.observe_memory(engine.last_beat)
        self.long_step.set(engine.long_step_s or 0.0)
        self.long_steps.set(engine.num_long_steps)

    def observe_memory(self, beat) -> None:
        """This process's resident memory, and the engine's from its last ``EngineHeartbeat``."""
        import os
        try:
            with open("/proc/self/statm") as f:
                self.api_rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, IndexError):
            pass
        if beat is not None:
            self.engine_rss.set(beat.resident_bytes)

    def sequence_started(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def sequence_finished(self, seq) -> None:
        """A ``SequenceState`` that finished (stop, length or abort)."""
        self.request_success.labels(finished_reason=seq.finish_reason or "abort", **self.labels).inc()
        n = len(seq.token_ids)
        self.generation_tokens.inc(n)
        end = seq.finished_time
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival_time)
            if n > 1 and end is not None:
                self.tpot.observe((end - seq.first_token_time) / (n - 1))
        if end is not None:
            self.e2e.observe(end - seq.arrival_time)
        if seq.queue_time is not None:
            self.queue_time.observe(seq.queue_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SplitwiseCollector:
    """The splitwise connector's counters (plugins/cache/splitwise.py), as the
    engine reports them: blocks and bytes moved, transfers, failures,
    rejected messages, and the transfer time histogram."""

    COUNTERS = {"blocks_sent": "KV blocks sent to decode instances.",
                "bytes_sent": "KV bytes sent to decode instances.",
                "blocks_received": "KV blocks received from prefill instances.",
                "bytes_received": "KV bytes received from prefill instances.",
                "transfers_sent": "KV transfers completed, prefill side.",
                "transfers_received": "KV transfers completed, decode side.",
                "transfers_failed": "KV transfers failed (refused, timed out, peer gone).",
                "messages_rejected": "Connector messages rejected (malformed, wrong version, secret or shape).",
                "first_token_agree": "Decode-side first tokens equal to the prefill side's.",
                "first_token_differ": "Decode-side first tokens different from the prefill side's."}

    def __init__(self, labels: dict):
        self.labels = labels
        self.stats: dict[str, float] = {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
        names, values = list(self.labels), list(self.labels.values())
        st = self.stats
        for key, doc in self.COUNTERS.items():
            c = CounterMetricFamily(f"fdx:splitwise_{key}", doc, labels=names)
            c.add_metric(values, st.get(f"splitwise_{key}", 0.0))
            yield c
        prefix = "splitwise_transfer_seconds_le_"
        buckets = sorted((float(k[len(prefix):]), v) for k, v in st.items() if k.startswith(prefix))
        h = HistogramMetricFamily("fdx:splitwise_transfer_seconds", "KV transfer time, reservation to confirm.",
                                  labels=names)
        h.add_metric(values, [(f"{le:g}", v) for le, v in buckets]
                     + [("+Inf", st.get("splitwise_transfer_seconds_count", 0.0))],
                     sum_value=st.get("splitwise_transfer_seconds_sum", 0.0))
        yield h
