"""Qwen2 / Qwen2.5: Llama with q/k/v biases (always on, o_proj has none)."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, DecoderForCausalLM, decoder_config

# transformers' Qwen2Config defaults, for keys a config.json may omit.
QWEN2_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False)


class Qwen2ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        return decoder_config(config, cls.architecture, QWEN2_DEFAULTS, qkv_bias=True)


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Qwen2ForCausalLM", Qwen2ForCausalLM)
