"""The engine parts a backend or the config names, from outside, each
written against ``fdx.core`` only; a part that extends a built-in finds it
by name in the plugin manager, never by importing ``fdx.plugins``.

- ``example-no-repeat`` token processor: the built-in contract (found as
  ``default``) plus one rule: ``max_repeats`` equal tokens in a row end the
  request as "stop" with ``stop_reason`` "repeat" (a ``Settings`` dataclass).
- ``example-argmax`` sampler: always the argmax, in numpy, with logprobs;
  the ``fakedev-argmax`` backend names it.
- ``example-counting`` model runner: the backend's ``default`` runner,
  counting the tokens it is given to compute (``backend.model_runner``).
- ``example-tally`` request scheduler: runs requests in the server's own
  engine and counts them on /metrics (``example_tally_requests_total``).
- ``example-scale`` activation function: the activations times ``factor``.

No Paddle at module level: the server's API process loads this module.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from pydantic import Field

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import (ModelRunner, RequestScheduler, Sampler, SamplerOutput, TokenLogprobs,
                                 TokenProcessor)
from fdx.core.request import RequestStatus

from fdx_example_plugin import FakeDevice


# --- a token processor -------------------------------------------------------------------

@dataclass
class NoRepeatSettings:
    max_repeats: Annotated[int, Field(ge=2, strict=True)] = 4   # equal tokens in a row that end a request


class NoRepeat(TokenProcessor):
    """The built-in token processor's rules, then: ``max_repeats`` equal
    tokens in a row (once ``min_tokens`` are out) end the request as "stop",
    ``stop_reason`` "repeat"."""
    Settings = NoRepeatSettings

    def __init__(self, settings: NoRepeatSettings, context):
        super().__init__(settings, context)
        from fdx.core.plugins import get_plugin_manager
        self.inner = get_plugin_manager().get("token_processor", "default")({}, context)

    def start(self, request):
        self.inner.start(request)

    def add_prompt_logprobs(self, request, start, entries):
        self.inner.add_prompt_logprobs(request, start, entries)

    def process(self, request, token_id, logprobs=None):
        if self.inner.process(request, token_id, logprobs):
            return True
        n = self.settings.max_repeats
        tail = request.output_token_ids[-n:]
        if len(tail) == n and len(set(tail)) == 1 and request.num_output_tokens >= request.sampling_params.min_tokens:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, "repeat"
            request.finished_time = time.monotonic()
            return True
        return False


# --- a sampler, and a backend that names it ------------------------------------------------

class Argmax(Sampler):
    """The most likely token of each row, whatever the request's temperature
    (an experiment's sampler); logprobs from the raw logits, in float64."""

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def sample(self, logits, batch, raw_logits=None):
        x = np.asarray(logits, dtype=np.float32)
        raw = np.asarray(x if raw_logits is None else raw_logits, dtype=np.float64)
        token_ids = x.argmax(axis=1).astype(np.int64)
        logprobs = []
        for i, params in enumerate(batch.params):
            if params.logprobs is None:
                logprobs.append(None)
                continue
            row = raw[i] - raw[i].max()
            lp = row - np.log(np.exp(row).sum())
            tid = int(token_ids[i])
            top = np.argsort(-lp, kind="stable")[:params.logprobs]
            logprobs.append(TokenLogprobs(tid, float(lp[tid]), 1 + int((lp > lp[tid]).sum()),
                                          [(int(t), float(lp[t])) for t in top]))
        return SamplerOutput(token_ids, logprobs)


class FakeDeviceArgmax(FakeDevice):
    """``fakedev`` with the ``example-argmax`` sampler."""
    name = "fakedev-argmax"
    sampler = "example-argmax"


# --- a model runner ------------------------------------------------------------------------

class CountingRunner(ModelRunner):
    """The ``default`` runner (looked up in the engine's plugin manager),
    counting the tokens each step gives it (``num_tokens``) and its steps."""

    def __init__(self, settings, context):
        ctx = context.runner                     # the RunnerContext (its settings: ctx.settings)
        super().__init__(settings, context)
        self.inner = ctx.plugins.get("model_runner", "default")(ctx.settings, context)
        self.num_tokens = self.num_steps = 0
        self.closed = False

    def execute(self, scheduler_output):
        self.num_steps += 1
        self.num_tokens += scheduler_output.total_num_scheduled_tokens
        return self.inner.execute(scheduler_output)

    def last_step_taps(self):
        return self.inner.last_step_taps()

    def close(self):
        self.closed = True
        self.inner.close()


# --- a request scheduler -------------------------------------------------------------------

class Tally(RequestScheduler):
    """Every request runs in the server's own engine; /metrics counts them
    as ``example_tally_requests_total{event="added"|"finished"|"aborted"}``."""

    def __init__(self, settings, context):
        metrics = context.metrics
        super().__init__(settings, context)
        from prometheus_client import Counter
        self.counts = Counter("example_tally_requests", "Requests seen by the example-tally request scheduler.",
                              ["event"], registry=metrics.registry)

    def add(self, request_id, prompt_token_ids, params, callback, trace=None):
        def counted(msg):
            if getattr(msg, "finish_reason", None) is not None:
                self.counts.labels(event="finished").inc()
            callback(msg)
        self.engine.add(request_id, prompt_token_ids, params, counted, trace)
        self.counts.labels(event="added").inc()

    def abort(self, request_ids):
        self.counts.labels(event="aborted").inc(len(request_ids))
        self.engine.abort(request_ids)


# --- an activation function ----------------------------------------------------------------

def scale(layer, positions, hidden, args):
    return hidden * float(args.get("factor", 1.0))


@hookimpl
def fdx_register_token_processors(register):
    register("example-no-repeat", NoRepeat)


@hookimpl
def fdx_register_samplers(register):
    register("example-argmax", Argmax)


@hookimpl
def fdx_register_backends(register):
    register("fakedev-argmax", FakeDeviceArgmax)


@hookimpl
def fdx_register_model_runners(register):
    register("example-counting", CountingRunner)


@hookimpl
def fdx_register_request_schedulers(register):
    register("example-tally", Tally)


@hookimpl
def fdx_register_activation_functions(register):
    register("example-scale", scale)
