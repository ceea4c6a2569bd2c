"""Mixture-of-experts decoders (Qwen2-MoE, Qwen3-MoE, ERNIE-4.5-MoE): the dense
decoder (fdx.plugins.models.decoder) whose MLP, in the layers the config
names, is a router over ``num_experts`` SwiGLU experts, of which each token
takes ``top_k``, plus, where the architecture has them, shared experts
every token runs.

The weights arrive under the names a Hugging Face folder stores them
(``model.layers.N.mlp.gate.weight`` for the router,
``mlp.experts.E.{gate,up,down}_proj.weight`` per expert); the GGUF loader
splits llama.cpp's stacked 3-D expert tensors into the same names, each
expert's bytes as the file holds them. Each expert's matrices are
``LinearWeight``s of the model's weight format, so a quantized expert stays
quantized and multiplies through the format's product; the router stays
float32 (its top-k choice is the architecture's, read from the file).

The compute (routing, the grouped expert products) is in
``fdx.plugins.models.moe_layers``, imported when a model is built: like
decoder.py, this module imports no Paddle.

A MoE layer never runs as the backend's fused decoder layer (``fused`` is
None), so the composed ops run it and the backend's one call for all
layers does not apply to such a model.

The constructor is DecoderForCausalLM's, with ``make_layer`` building the
MoE layers; ``forward`` is the dense decoder's, plus ERNIE's optional head bias.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

from fdx.core.interfaces import AttentionContext, BuildContext
from fdx.plugins.models.decoder import DecoderForCausalLM
from fdx.plugins.models.moe_config import EXPERT_SHARE, MoeConfig, check_moe, expert_parallel_counts

__all__ = ["MoeConfig", "MoeDecoderForCausalLM", "check_moe"]

if TYPE_CHECKING:
    from paddle import Tensor


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """``DecoderForCausalLM`` with MoE MLPs in ``parse_moe_config``'s layers.

    Tensor parallel splits each expert's intermediate dimension (and the
    shared experts' and the dense layers') the way the dense MLP is split;
    the router stays whole on every rank and the layer's output is summed
    over the ranks once, after the routed and shared parts are added.
    Expert parallel (``shard(..., groups)``) gives each group of ranks whole
    experts instead (``moe_config.ExpertShare``); built while
    ``moe_config.EXPERT_SHARE`` is set, the model takes only its share of
    the experts out of the checkpoint."""

    architecture: ClassVar[str] = "MoeDecoderForCausalLM"
    supports_pooling = True
    supports_lora = False           # the experts take no adapter (LoRA on MoE layers is not built)

    @classmethod
    def parse_moe_config(cls, config: dict[str, Any]) -> MoeConfig:
        raise NotImplementedError

    def __init__(self, settings: Any, context: BuildContext):
        from fdx.plugins.models.moe_layers import default_router
        config, weights = context.hf_config, context.weights
        self.moe = check_moe(self.architecture, self.parse_config(config).num_layers, self.parse_moe_config(config))
        self._router = default_router(self.moe)
        self._share = EXPERT_SHARE.get()          # expert parallel: the experts this rank will hold
        super().__init__(settings, context)
        from fdx.plugins.models.layers import Weights
        # ERNIE-4.5-MoE's head takes a bias with use_bias (transformers' nn.Linear(bias=use_bias))
        self.lm_head_bias = (Weights(self.architecture, weights, self.weight_format).vector(
            "lm_head.bias", self.cfg.vocab_size) if "lm_head.bias" in weights else None)

    def make_layer(self, cfg, w, index: int, rope):
        from fdx.plugins.models.moe_layers import MoeDecoderLayer
        if index in self.moe.moe_layers:
            return MoeDecoderLayer(cfg, self.moe, w, index, rope, self._router, self._share)
        return super().make_layer(cfg, w, index, rope)

    @property
    def moe_blocks(self) -> list:
        """The MoE MLPs, in layer order."""
        return [layer.mlp for layer in self.layers if getattr(layer, "is_moe", False)]

    def set_router(self, router: Callable[[Any], tuple[Any, Any]]) -> None:
        """Replace the top-k choice in every MoE layer: ``router(logits,
        bias)`` takes the router's float32 logits (numpy ``[rows,
        num_experts]``) and the checkpoint's expert-choice bias (ERNIE's
        ``e_score_correction_bias``, float32 ``[num_experts]``, or None) and
        returns ``(expert ids int64 [rows, k], weights float32 [rows, k])``."""
        for block in self.moe_blocks:
            block.router = router

    def last_expert_load(self) -> list[list[int]]:
        """Tokens routed to each expert in each MoE layer by the last forward
        (``[moe layers][num_experts]``; zeros before the first)."""
        return [block.last_load.tolist() for block in self.moe_blocks]

    @classmethod
    def shard_errors(cls, config: dict[str, Any], world: int, groups: int = 1) -> list[str]:
        """Why the checkpoint's config cannot split over ``world`` ranks in
        ``groups`` expert-parallel groups: each reason names its config key
        ([] when it can). The engine asks before any worker starts."""
        return cls._shard_errors(cls.parse_config(config), cls.parse_moe_config(config), world, groups)

    @classmethod
    def _shard_errors(cls, cfg, moe: MoeConfig, world: int, groups: int) -> list[str]:
        counts = [("parallel.tensor_parallel_size", "num_attention_heads", cfg.num_heads, world),
                  ("parallel.tensor_parallel_size", "num_key_value_heads", cfg.num_kv_heads, world),
                  *expert_parallel_counts(moe, world, groups)]
        if len(moe.moe_layers) < cfg.num_layers:
            counts.append(("parallel.tensor_parallel_size", "intermediate_size", cfg.intermediate_size, world))
        if moe.shared_intermediate_size:
            counts.append(("parallel.tensor_parallel_size", "shared expert intermediate size",
                           moe.shared_intermediate_size, world))
        sizes = f"tensor_parallel_size={world}" + (f", expert_parallel_size={groups}" if groups > 1 else "")
        return [f"config key '{key}': {cls.architecture}: {what}={count} does not divide by {by} ({sizes})"
                for key, what, count, by in counts if count % by]

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor], groups: int = 1) -> None:
        """Tensor parallel over ``world`` ranks; with ``groups`` > 1 (expert
        parallel) the MoE layers' experts go whole to ``groups`` groups of
        ranks (``SparseMoe.shard``), all else splits as tensor parallel does."""
        errors = self._shard_errors(self.cfg, self.moe, world, groups)
        if errors:
            raise ValueError(errors[0])
        cfg = self.cfg
        for layer in self.layers:
            layer.attn.shard(rank, world, reduce)
            if getattr(layer, "is_moe", False):
                layer.mlp.shard(rank, world, reduce, groups)
            else:
                layer.mlp.shard(rank, world, reduce)
            layer.weights_changed()
        self.num_heads, self.num_kv_heads = cfg.num_heads // world, cfg.num_kv_heads // world

    def weight_bytes(self) -> dict[str, int]:
        from fdx.plugins.models.weight_formats import weight_bytes
        held = [self.embed_tokens, self.norm, self.lm_head_bias] + (
            [] if self.lm_head is self.embed_tokens else [self.lm_head])
        for layer in self.layers:
            a = layer.attn
            held += [layer.input_norm, layer.post_norm, a.wqkv, a.bqkv, a.wo, a.bo, a.q_norm, a.k_norm,
                     *layer.mlp.held()] if getattr(layer, "is_moe", False) else [
                layer.input_norm, layer.post_norm, a.wqkv, a.bqkv, a.wo, a.bo, a.q_norm, a.k_norm,
                layer.mlp.w_gate_up, layer.mlp.b_gate_up, layer.mlp.w_down, layer.mlp.b_down]
        return weight_bytes(held)

    def cast(self, dtype: str) -> None:
        """float32 only (the MoE layers' first target)."""
        if dtype != "float32":
            raise ValueError(f"config key 'model.dtype': {self.architecture} computes in float32 only, "
                             f"not {dtype}")

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list, meta: AttentionContext,
                logits_indices: Tensor) -> Tensor:
        logits = super().forward(input_ids, positions, kv_caches, meta, logits_indices)
        return logits if self.lm_head_bias is None else logits + self.lm_head_bias

    def drop_lm_head(self) -> None:
        super().drop_lm_head()
        self.lm_head_bias = None

    __call__ = forward
