"""ERNIE-4.5-MoE (e.g. ERNIE-4.5-21B-A3B): dense ERNIE-4.5's attention
(interleaved RoPE pairs, ``use_bias``) with a routed MLP in layers
``moe_layer_start_index`` .. ``moe_layer_end_index`` every
``moe_layer_interval``: softmax over ``moe_num_experts``, the ``moe_k``
experts chosen by probability plus ``moe_statics.e_score_correction_bias``
and weighted by the plain probability renormalized (divisor at least
``moe_norm_min``), plus ``moe_num_shared_experts`` shared experts run as
one MLP of ``moe_intermediate_size * moe_num_shared_experts``
(transformers' modeling_ernie4_5_moe.py)."""
from __future__ import annotations

from typing import Any

from fdx.core.hookspecs import Register, hookimpl
from fdx.plugins.models.decoder import DecoderConfig, decoder_config
from fdx.plugins.models.moe_decoder import MoeConfig, MoeDecoderForCausalLM

# transformers' Ernie4_5_MoeConfig defaults, for keys a config.json may omit
# (no head_dim there: hidden_size // num_attention_heads).
ERNIE4_5_MOE_DEFAULTS: dict[str, Any] = dict(
    hidden_act="silu", max_position_embeddings=131072, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=True, intermediate_size=12288)


def _int(config: dict[str, Any], keys: tuple[str, ...], default: int, arch: str) -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if isinstance(value, (list, tuple)):
                raise NotImplementedError(f"{arch}: {key}={value!r}: per-modality expert groups are "
                                          "not supported (one group of experts only)")
            return int(value)
    return default


class Ernie4_5_MoeForCausalLM(MoeDecoderForCausalLM):
    architecture = "Ernie4_5_MoeForCausalLM"

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        bias = bool(config.get("use_bias", False))
        return decoder_config(config, cls.architecture, ERNIE4_5_MOE_DEFAULTS, qkv_bias=bias,
                              o_bias=bias, mlp_bias=bias, rope_interleaved=True)

    @classmethod
    def parse_moe_config(cls, config: dict[str, Any]) -> MoeConfig:
        arch = cls.architecture
        num_layers = int(config["num_hidden_layers"])
        start = _int(config, ("moe_layer_start_index",), 1, arch)
        end = _int(config, ("moe_layer_end_index",), -1, arch)
        end = num_layers - 1 if end == -1 else end
        interval = _int(config, ("moe_layer_interval",), 1, arch)
        if interval < 1:
            raise ValueError(f"{arch}: moe_layer_interval={interval}: expected at least 1")
        inter = _int(config, ("moe_intermediate_size",), 1536, arch)
        shared = _int(config, ("moe_num_shared_experts",), 2, arch)
        layers = tuple(i for i in range(num_layers) if (i + 1) % interval == 0 and start <= i <= end)
        return MoeConfig(num_experts=_int(config, ("moe_num_experts", "num_experts"), 64, arch),
                         top_k=_int(config, ("moe_k", "num_experts_per_tok"), 6, arch),
                         moe_intermediate_size=inter, moe_layers=layers, routing="ernie",
                         norm_min=float(config.get("moe_norm_min") or 1e-12), score_correction_bias=True,
                         shared_intermediate_size=inter * shared, shared_prefix="shared_experts",
                         mlp_bias=bool(config.get("use_bias", False)))


@hookimpl
def fdx_register_models(register: Register) -> None:
    register("Ernie4_5_MoeForCausalLM", Ernie4_5_MoeForCausalLM)
