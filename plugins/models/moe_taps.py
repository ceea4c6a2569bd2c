"""The expert-load tap: ``StepStats.expert_load`` for a mixture-of-experts
model: the tokens the step routed to each expert, per MoE layer, as
``MoeDecoderForCausalLM.last_expert_load()`` counted them, in the engine's
process (``engine.model``) or, under tensor and expert parallel, on rank 0,
which sends it back with the step's result (the executor's
``last_expert_load()``: every rank routes every row, so rank 0's count is
the step's). Other observers of ``fdx_step_finished`` see it filled.
Imports no Paddle."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl


# trylast: the plugin manager's notify() calls implementations in
# get_hookimpls() order, where pluggy puts trylast ones first, so this runs
# before every other observer of the step.
@hookimpl(trylast=True)
def fdx_step_finished(scheduler_output: Any, step_stats: Any, context: Any) -> None:
    engine = context.engine
    if engine is None:
        return
    source = engine.model if engine.model is not None else engine.executor   # Model / Executor.last_expert_load
    if scheduler_output.total_num_scheduled_tokens > 0:
        value = source.last_expert_load()
        if value is not None:
            step_stats.expert_load = value
