"""Expert parallel (``parallel.expert_parallel_size``, ``--enable-expert-parallel``)
on the tensor-parallel ranks of the ``tp`` executor (fdx.plugins.backends.tp).

The ``tensor_parallel_size`` ranks form ``expert_parallel_size`` groups of
consecutive ranks; group g holds experts ``[g E/G, (g+1) E/G)`` of every MoE
layer whole but for their intermediate columns, which split over the group's
ranks (``fdx.plugins.models.moe_config.ExpertShare``). Attention, the dense
MLPs, the shared experts and the router split (or stay whole) as under
tensor parallel alone, so after attention every rank holds every row of the
step: the router's choice is made on every rank, each rank multiplies the
(row, slot) places whose expert it holds, and the layer's partial outputs
are summed over all ranks by the all-reduce tensor parallel already makes
there (one collective a MoE layer, the same size as without expert
parallel). An all-to-all (rows sent to their experts' ranks and back) would
be two exchanges a layer where the rows are already everywhere; Paddle's
gloo has no all-to-all (``ProcessGroupGLOO does not support all_to_all``),
and its all_gather, which would stand in for it, measured no faster than
all_reduce at a decode step's size and slower at a prefill's
(docs/architecture.md "Mixture-of-experts layers").

Each rank builds its model with ``moe_config.EXPERT_SHARE`` set, so a MoE
layer converts (quantizes, stacks) only its own experts and drops the
others' tensors as it meets them (a GGUF file's other experts, kept in their
block type, are never read; a Hugging Face folder is read whole by the loader first).

``check`` refuses, before any worker starts, what cannot split (a ConfigError
naming the key); ``load_rank_model`` is a rank's load and shard.
"""
from __future__ import annotations

from typing import Any, Callable

from fdx.core.config import ConfigError

KEY = "config key 'parallel.expert_parallel_size'"


def check(config, cls: type, arch: str, model_config: dict[str, Any]) -> None:
    """Whether the model class can split over the config's ranks and expert
    groups: a ConfigError naming the key that cannot (also the tensor-parallel
    counts of a MoE model, which its ``shard_errors`` knows)."""
    world, groups = config.parallel.tensor_parallel_size, config.parallel.expert_parallel_size
    found = cls.shard_errors(model_config, world, groups)       # Model.shard_errors: None without MoE layers
    if found is None:
        if groups > 1:
            raise ConfigError(f"{KEY}: {groups}: the model {cls.__name__} ({arch}) has no mixture-of-experts "
                              "layers to split over expert-parallel ranks (Model.shard_errors is None); "
                              "leave it at 1")
        return
    if found:
        raise ConfigError(found[0])


def load_rank_model(config, plugins, kernels, rank: int, world: int, reduce: Callable) -> tuple[Any, Any]:
    """(model, checkpoint) of tensor-parallel rank ``rank``: loaded holding
    its share of the experts when expert parallel is on, and sharded."""
    from fdx.model_io.model import load_model
    from fdx.plugins.models.moe_config import ExpertShare, building_share
    groups = config.parallel.expert_parallel_size
    with building_share(ExpertShare(rank, world, groups) if groups > 1 else None):
        model, ckpt = load_model(config, plugins, kernels, progress=False, defer_tokenizer=True)
    if groups > 1:
        model.shard(rank, world, reduce, groups)
    else:
        model.shard(rank, world, reduce)
    return model, ckpt


def expert_load(model: Any) -> list[list[int]] | None:
    """The last forward's tokens per expert per MoE layer (rank 0 sends it
    back with the step's result: every rank routes every row), or None for
    a model without MoE layers."""
    return model.last_expert_load()
