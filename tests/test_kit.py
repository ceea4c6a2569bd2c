"""The conformance kit catches what broken plugins do (issue 19): a logits
processor that counts the batch's steps instead of each request's tokens
fails on every seed; a scheduler that always passes over the
longest-waiting prompt fails the bounded-wait property unless it declares
itself unfair; a failure prints the whole workload; a victim policy is
asked even when one candidate is left."""
from __future__ import annotations

import numpy as np
import pytest

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LogitsProcessor, PreemptionPolicy, SchedulerPolicy
from fdx.core.plugins import PluginManager
from fdx.core.sampling_params import SamplingParams
from fdx.core.testing import EOS, check_logits_processor, check_scheduler, run_workload


# --- logits processors ----------------------------------------------------------------

class StopAfter(LogitsProcessor):
    """extra_args={"stop_after": n}: only EOS after n tokens of the request."""

    def update_state(self, update):
        self.limits = getattr(self, "limits", {})
        for rid in update.removed:
            self.limits.pop(rid, None)
        for row in update.added:
            self.limits[row.request_id] = ((row.params.extra_args or {}).get("stop_after"), row.output_token_ids)
        self.rows = update.rows

    def done(self, rid) -> bool:
        n, outputs = self.limits.get(rid, (None, ()))
        return n is not None and len(outputs) >= n

    def apply(self, logits):
        for i, rid in enumerate(self.rows):
            if self.done(rid):
                logits[i, :] = -np.inf
                logits[i, EOS] = 0
        return logits


class StepCountingStopAfter(StopAfter):
    """The researcher's bug: counts the batch's steps, not the request's tokens."""

    def update_state(self, update):
        super().update_state(update)
        self.steps = getattr(self, "steps", 0) + 1

    def done(self, rid) -> bool:
        n, _ = self.limits.get(rid, (None, ()))
        return n is not None and self.steps > n


class Processors:
    @hookimpl
    def fdx_register_logits_processors(self, register):
        register("kit-stop-after", StopAfter)
        register("kit-step-counting", StepCountingStopAfter)


@pytest.fixture(scope="module")
def processors():
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Processors(), name="kit-processors")
    return pm


PARAM_SETS = [[SamplingParams(extra_args={"stop_after": 2}), SamplingParams()],
              [SamplingParams(), SamplingParams(extra_args={"stop_after": 1})],
              [SamplingParams(extra_args={"stop_after": 3}), SamplingParams(), SamplingParams(extra_args={"stop_after": 1})]]


@pytest.mark.parametrize("params", PARAM_SETS)
def test_the_step_counting_processor_fails_on_every_seed(processors, params):
    for seed in range(8):
        with pytest.raises(AssertionError, match="kit-step-counting: row .* at step"):
            check_logits_processor("kit-step-counting", params, seed=seed, plugin_manager=processors)


@pytest.mark.parametrize("params", PARAM_SETS)
def test_the_per_request_processor_passes_on_every_seed(processors, params):
    for seed in range(8):
        check_logits_processor("kit-stop-after", params, seed=seed, plugin_manager=processors)


def test_the_failure_names_the_schedule_and_the_parameter_order(processors):
    with pytest.raises(AssertionError) as e:
        check_logits_processor("kit-step-counting", PARAM_SETS[0], seed=3, plugin_manager=processors)
    assert "parameter order [" in str(e.value) and "batch rows per step (request indices): [[0]" in str(e.value)


# --- schedulers -------------------------------------------------------------------------

class SkipsTheLongestWaiting(SchedulerPolicy):
    """v1's loops, except that the longest-waiting request that never ran is
    passed over while any other waits (it runs only once alone)."""

    def schedule(self, core):
        core.schedule_running()
        if core.preempted_ids:
            return
        fresh = [r for r in core.waiting if not r.num_preemptions]
        skip = fresh[0] if len(fresh) > 1 else None
        for req in list(core.waiting):
            if req is skip:
                continue
            if len(core.running) >= core.max_num_seqs or core.budget <= 0 or not core.may_admit(req):
                break
            hit, external = core.lookup(req)
            n = core.default_grant(req, hit, external)
            if n is None or not core.admit(req, hit, external, n):
                break
            core.schedule_request(req, n)


class DeclaredUnfair(SkipsTheLongestWaiting):
    bounded_wait = False


class CountingVictim(PreemptionPolicy):
    CALLS: list[int] = []

    def choose_victim(self, running, state):
        self.CALLS.append(len(running))
        return running[-1]


class Schedulers:
    @hookimpl
    def fdx_register_resource_managers(self, register):
        register("kit-skips-oldest", SkipsTheLongestWaiting)
        register("kit-declared-unfair", DeclaredUnfair)

    @hookimpl
    def fdx_register_preemption_policies(self, register):
        register("kit-counting", CountingVictim)


@pytest.fixture(scope="module")
def schedulers():
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Schedulers(), name="kit-schedulers")
    return pm


def workload(requests, **kw):
    w = dict(bs=4, max_model_len=24, num_blocks=40, chunked=True, budget=64, max_num_seqs=1, swap=0)
    w.update(kw)
    w["requests"] = [dict(arrival=a, prompt=p, max_tokens=m, priority=0, salt=None, abort_after=None)
                     for a, p, m in requests]
    return w


THREE = [(0, [5, 6, 7], 3), (0, [8, 9], 3), (0, [10, 11, 12, 13], 3)]


def test_passing_over_the_longest_waiting_prompt_fails_bounded_wait(schedulers):
    with pytest.raises(AssertionError, match="bounded wait: r1 started while r0"):
        run_workload("kit-skips-oldest", "paged", "fcfs", workload(THREE), plugin_manager=schedulers)
    # v1 on the same workload starts them in arrival order
    reqs, _, _ = run_workload("v1", "paged", "fcfs", workload(THREE), plugin_manager=schedulers)
    firsts = sorted(reqs.values(), key=lambda r: r.first_scheduled_time)
    assert [r.request_id for r in firsts] == ["r0", "r1", "r2"]


def test_a_policy_that_declares_itself_unfair_is_held_to_liveness_only(schedulers):
    reqs, _, _ = run_workload("kit-declared-unfair", "paged", "fcfs", workload(THREE), plugin_manager=schedulers)
    firsts = sorted(reqs.values(), key=lambda r: r.first_scheduled_time)
    assert [r.request_id for r in firsts] == ["r1", "r2", "r0"]       # it did pass r0 over, and r0 finished
    check_scheduler("kit-declared-unfair", max_examples=10, plugin_manager=schedulers)


def test_admission_refusals_are_not_passing_over(example_plugin_installed):
    """tenant-cap refuses a second request of one tenant: the next one may start."""
    check_scheduler("v1", "paged", admission=["tenant-cap"], max_examples=10)


@pytest.mark.slow          # hypothesis shrinks the failure: about a minute
def test_a_kit_failure_prints_the_whole_workload(schedulers):
    with pytest.raises(AssertionError) as e:
        check_scheduler("kit-skips-oldest", max_examples=40, plugin_manager=schedulers)
    text = str(e.value)
    assert "bounded wait:" in text
    assert "fdx.core.testing.run_workload('kit-skips-oldest', 'paged', 'fcfs', w," in text
    w_text = text.split("\nw = ", 1)[1]
    w = eval(w_text)                                      # the printed workload reproduces the failure
    with pytest.raises(AssertionError, match="bounded wait"):
        run_workload("kit-skips-oldest", "paged", "fcfs", w, plugin_manager=schedulers)


def test_a_victim_policy_is_asked_also_with_one_candidate(schedulers):
    """A 4-block pool: r0 (5 tokens) and r1 (8 tokens) hold 2 blocks each.
    At the first decode r0 still fits its second block; r1, the last one
    running, needs a third: the policy is asked with r1 alone."""
    CountingVictim.CALLS.clear()
    w = workload([(0, [5, 6, 7, 8, 9], 2), (0, [12, 13, 14, 15, 16, 17, 18, 19], 2)],
                 num_blocks=4, max_num_seqs=2, max_model_len=12)
    run_workload("v1", "paged", "fcfs", w, preemption="kit-counting", plugin_manager=schedulers)
    assert CountingVictim.CALLS == [1]
