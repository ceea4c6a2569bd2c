"""Qwen2-MoE (e.g. Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention
(q/k/v biases, ``qkv_bias``) with a routed MLP as Qwen3-MoE's (softmax,
top ``num_experts_per_tok``, renormalized when ``norm_topk_prob``) plus a
shared expert of ``shared_expert_intermediate_size`` every row runs, its
output scaled by ``sigmoid(shared_expert_gate(x))`` (transformers'
modeling_qwen2_moe.py)."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, decoder_config
from fdx.plugins.models.moe_decoder import MoeConfig, MoeDecoderForCausalLM
from fdx.plugins.models.qwen3_moe import _get

# transformers' Qwen2MoeConfig defaults, for keys a config.json may omit.
QWEN2_MOE_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False, intermediate_size=5632)


class Qwen2MoeForCausalLM(MoeDecoderForCausalLM):
    architecture = "Qwen2MoeForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        return decoder_config(config, cls.architecture, QWEN2_MOE_DEFAULTS,
                              qkv_bias=bool(config.get("qkv_bias", True)))

    @classmethod
    def parse_moe_config(cls, config: dict[str, Any]) -> MoeConfig:
        num_layers = int(config["num_hidden_layers"])
        experts = int(_get(config, ("num_experts", "num_local_experts"), 60))
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return MoeConfig(num_experts=experts, top_k=int(config.get("num_experts_per_tok") or 4),
                         moe_intermediate_size=int(config.get("moe_intermediate_size") or 1408),
                         moe_layers=layers, routing="softmax_topk",
                         norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                         shared_intermediate_size=int(config.get("shared_expert_intermediate_size") or 5632),
                         shared_prefix="shared_expert", shared_gate=True)


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Qwen2MoeForCausalLM", Qwen2MoeForCausalLM)
