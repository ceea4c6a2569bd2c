"""A third-party fdx plugin: a shortest-prompt-first resource manager and a
step observer. It is installed with pip and found through the ``fdx``
entry-point group; fdx itself knows nothing about it."""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.plugins.schedulers.v1 import V1ResourceManager

# what the observer saw, for tests to read
STEPS: list[tuple[int, int]] = []      # (step, num_scheduled_tokens)
STARTED: list[object] = []
FINISHED: list[str] = []


class ShortestPromptFirst(V1ResourceManager):
    """v1, but the waiting queue is ordered by prompt length (shortest
    first) instead of arrival. Preempted requests still go first."""

    def add_request(self, request) -> None:
        super().add_request(request)
        ordered = sorted(self.waiting, key=lambda r: (r.num_preemptions == 0, r.num_prompt_tokens))
        self.waiting.clear()
        self.waiting.extend(ordered)


@hookimpl
def fdx_register_resource_managers(register):
    register("shortest-first", ShortestPromptFirst)


@hookimpl
def fdx_engine_started(engine):
    STARTED.append(engine)


@hookimpl
def fdx_step_finished(scheduler_output, step_stats):
    STEPS.append((step_stats.step, step_stats.num_scheduled_tokens))


@hookimpl
def fdx_request_finished(request, output):
    FINISHED.append(request.request_id)
