"""The MoE part of a decoder's parsed config: what
fdx.plugins.models.moe_decoder reads out of a Hugging Face config.json
beside ``DecoderConfig``, and what fdx.plugins.models.moe_layers builds
from. Plain data, no Paddle."""
from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator


@dataclass(slots=True, frozen=True)
class MoeConfig:
    """What a MoE architecture adds to ``DecoderConfig`` (plain data)."""
    num_experts: int
    top_k: int
    moe_intermediate_size: int           # each routed expert's intermediate width
    moe_layers: tuple[int, ...]          # the layers whose MLP routes (the others are dense)
    routing: str                         # "softmax_topk" (Qwen3-MoE) or "ernie" (bias-corrected choice)
    norm_topk_prob: bool = False         # renormalize the chosen top-k probabilities to sum 1
    norm_min: float = 1e-12              # ERNIE: the renormalization's divisor is at least this
    score_correction_bias: bool = False  # ERNIE: moe_statics.e_score_correction_bias picks the experts
    shared_intermediate_size: int = 0    # the shared experts' MLP width (0: none)
    shared_prefix: str = "shared_experts"   # its HF module name under mlp.
    shared_gate: bool = False            # Qwen2-MoE: the shared output times sigmoid(shared_expert_gate(x))
    mlp_bias: bool = False               # biases on the dense and shared MLPs (ERNIE use_bias)


def check_moe(arch: str, num_layers: int, moe: MoeConfig) -> MoeConfig:
    """Reject a MoE config that cannot run, naming the key."""
    if moe.num_experts < 1:
        raise ValueError(f"{arch}: num_experts={moe.num_experts}: expected at least 1")
    if not 1 <= moe.top_k <= moe.num_experts:
        raise ValueError(f"{arch}: num_experts_per_tok={moe.top_k} must be between 1 and "
                         f"num_experts={moe.num_experts}")
    if moe.moe_intermediate_size < 1:
        raise ValueError(f"{arch}: moe_intermediate_size={moe.moe_intermediate_size}: expected at least 1")
    bad = [i for i in moe.moe_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{arch}: MoE layer indices {bad} are outside the {num_layers} layers")
    return moe


# --- expert parallel: which experts and columns a rank holds (issue 39 item 3) -------------------

@dataclass(slots=True, frozen=True)
class ExpertShare:
    """Rank ``rank`` of ``world`` tensor-parallel ranks, in ``groups``
    (parallel.expert_parallel_size) groups of ``world // groups`` consecutive
    ranks: group g holds experts ``[g * E/groups, (g+1) * E/groups)`` whole
    but for their intermediate columns, split over the group's ranks."""
    rank: int
    world: int
    groups: int

    @property
    def per_group(self) -> int:          # ranks in a group: each holds 1/per_group of its experts' columns
        return self.world // self.groups

    @property
    def column_part(self) -> int:        # this rank's part of its experts' columns, 0 .. per_group-1
        return self.rank % self.per_group

    def experts(self, num_experts: int) -> tuple[int, int]:
        """[first, end) of the experts this rank's group holds."""
        n = num_experts // self.groups
        g = self.rank // self.per_group
        return g * n, (g + 1) * n


def expert_parallel_counts(moe: MoeConfig, world: int, groups: int) -> list[tuple[str, str, int, int]]:
    """(config key it is set by, what, count, divisor) that must divide for
    ``groups`` expert-parallel groups of ``world`` ranks (the attention,
    dense and shared MLPs split over all ``world`` as tensor parallel does)."""
    return [("parallel.expert_parallel_size", "num_experts", moe.num_experts, groups),
            ("parallel.tensor_parallel_size", "moe_intermediate_size", moe.moe_intermediate_size,
             world // groups)]


# Set while a tensor-parallel rank builds its model (fdx.plugins.backends.expert_parallel): a MoE
# layer then takes only its share's experts out of the checkpoint; the others are dropped unconverted.
EXPERT_SHARE: ContextVar[ExpertShare | None] = ContextVar("fdx_expert_share", default=None)


@contextlib.contextmanager
def building_share(share: ExpertShare | None) -> Iterator[None]:
    token = EXPERT_SHARE.set(share)
    try:
        yield
    finally:
        EXPERT_SHARE.reset(token)
