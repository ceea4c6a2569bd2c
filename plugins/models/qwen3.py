"""Qwen3 (dense): per-head RMS norm on q and k before RoPE, and a head_dim
of its own (default 128, independent of hidden_size / heads)."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, DecoderForCausalLM, decoder_config

# transformers' Qwen3Config defaults, for keys a config.json may omit.
QWEN3_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False, head_dim=128)


class Qwen3ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("attention_bias", False))
        return decoder_config(config, cls.architecture, QWEN3_DEFAULTS,
                              qkv_bias=bias, o_bias=bias, qk_norm=True)


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Qwen3ForCausalLM", Qwen3ForCausalLM)
