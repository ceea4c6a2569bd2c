"""The decoder's parsed config: what fdx.plugins.models.decoder reads out
of a Hugging Face config.json, and what its compute blocks
(fdx.plugins.models.layers) are built from. Plain data, no Paddle."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None  # llama3 parameters; None = plain RoPE
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1) (ERNIE) instead of halves
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMS norm on q and k before RoPE (Qwen3)
