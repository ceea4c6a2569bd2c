"""ERNIE-4.5 dense (e.g. ERNIE-4.5-0.3B): one ``use_bias`` flag for every
projection, and RoPE on interleaved pairs.

transformers' apply_rotary_pos_emb for ernie4_5 takes the first half of
cos/sin, repeat_interleaves it (cos[2i] = cos[2i+1] = cos(p * f_i)) and
rotates with x[2i] -> -x[2i+1], x[2i+1] -> x[2i]: GPT-J style pairs, not
Llama's halves, with the usual frequencies f_i = theta^(-2i / D).
"""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, DecoderForCausalLM, decoder_config

# transformers' Ernie4_5Config defaults, for keys a config.json may omit.
ERNIE4_5_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, head_dim=128)


class Ernie4_5ForCausalLM(DecoderForCausalLM):
    architecture = "Ernie4_5ForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("use_bias", False))
        return decoder_config(config, cls.architecture, ERNIE4_5_DEFAULTS, qkv_bias=bias,
                              o_bias=bias, mlp_bias=bias, rope_interleaved=True)


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Ernie4_5ForCausalLM", Ernie4_5ForCausalLM)
