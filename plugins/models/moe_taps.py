"""The expert-load tap: ``StepStats.expert_load`` for a mixture-of-experts
model the engine runs in-process (``engine.model``; None under tensor
parallel, whose ranks hold the model): the tokens the step routed to each
expert, per MoE layer, as ``MoeDecoderForCausalLM.last_expert_load()``
counted them. Other observers of ``fdx_step_finished`` see it filled.
Imports no Paddle."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import hookimpl


# trylast: the plugin manager's notify() calls implementations in
# get_hookimpls() order, where pluggy puts trylast ones first, so this runs
# before every other observer of the step.
@hookimpl(trylast=True)
def fdx_step_finished(scheduler_output: Any, step_stats: Any, context: Any) -> None:
    model = getattr(getattr(context, "engine", None), "model", None)
    load = getattr(model, "last_expert_load", None)
    if load is not None and scheduler_output.total_num_scheduled_tokens > 0:
        step_stats.expert_load = load()
