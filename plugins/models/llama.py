"""Llama (SmolLM2, Llama 2/3): the plain decoder, optional biases, llama3 RoPE."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, DecoderForCausalLM, decoder_config

# transformers' LlamaConfig defaults, for keys a config.json may omit
# (head_dim defaults to hidden_size // num_attention_heads).
LLAMA_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False)


class LlamaForCausalLM(DecoderForCausalLM):
    architecture = "LlamaForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return decoder_config(config, cls.architecture, LLAMA_DEFAULTS, qkv_bias=bias,
                              o_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("LlamaForCausalLM", LlamaForCausalLM)
