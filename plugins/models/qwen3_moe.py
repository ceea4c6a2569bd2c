"""Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (per-head q/k norms)
with a routed MLP: softmax over ``num_experts``, the top
``num_experts_per_tok`` (renormalized when ``norm_topk_prob``), no shared
experts. Layers in ``mlp_only_layers``, or off the ``decoder_sparse_step``
rhythm, keep a dense MLP of ``intermediate_size``."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, decoder_config
from fdx.plugins.models.moe_decoder import MoeConfig, MoeDecoderForCausalLM

# transformers' Qwen3MoeConfig defaults, for keys a config.json may omit.
QWEN3_MOE_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False, intermediate_size=6144)


def _get(config: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


class Qwen3MoeForCausalLM(MoeDecoderForCausalLM):
    architecture = "Qwen3MoeForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return decoder_config(config, cls.architecture, QWEN3_MOE_DEFAULTS,
                              qkv_bias=bias, o_bias=bias, qk_norm=True)

    @classmethod
    def parse_moe_config(cls, config: dict[str, Any]) -> MoeConfig:
        num_layers = int(config["num_hidden_layers"])
        experts = int(_get(config, ("num_experts", "num_local_experts"), 128))
        step = int(config.get("decoder_sparse_step") or 1)
        dense = set(config.get("mlp_only_layers") or [])
        layers = tuple(i for i in range(num_layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return MoeConfig(num_experts=experts, top_k=int(config.get("num_experts_per_tok") or 8),
                         moe_intermediate_size=int(config.get("moe_intermediate_size") or 768),
                         moe_layers=layers, routing="softmax_topk",
                         norm_topk_prob=bool(config.get("norm_topk_prob", False)))


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Qwen3MoeForCausalLM", Qwen3MoeForCausalLM)
