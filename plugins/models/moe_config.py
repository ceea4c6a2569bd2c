"""The MoE part of a decoder's parsed config: what
fdx.plugins.models.moe_decoder reads out of a Hugging Face config.json
beside ``DecoderConfig``, and what fdx.plugins.models.moe_layers builds
from. Plain data, no Paddle."""
from __future__ import annotations

from dataclasses import dataclass


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
