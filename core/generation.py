"""Generation defaults: the model's own, then fdx's for chat.

A model may ship sampling defaults: Hugging Face's generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens: the
keys vLLM reads) or a GGUF file's ``general.sampling.*`` metadata. They
apply wherever a request leaves the field unset, as in vLLM. Where the
model ships none, chat requests (``LLM.chat``, ``fdx chat``,
``/v1/chat/completions``) get ``CHAT_DEFAULTS``: with the SamplingParams
defaults (temperature 1, 16 tokens) a small model's answer is cut off or
loops. Completions keep the SamplingParams / OpenAI defaults.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# What SmolLM2-135M-Instruct needs to answer the README's examples completely
# and without looping (18 of 18 seeded runs ended with "stop", no line three
# times; temperature 0.7 and top_p 0.9 alone looped in 1 of 18).
CHAT_DEFAULTS: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1, "max_tokens": 1024}

# generation_config.json key -> SamplingParams field
_HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# GGUF metadata key -> SamplingParams field
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
              "general.sampling.penalty_repeat": "repetition_penalty"}
_INT_FIELDS = {"top_k", "max_tokens"}


def _clean(pairs: Mapping[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name in keys.items():
        value = pairs.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out[name] = int(value) if name in _INT_FIELDS else float(value)
    return out


def from_hf_dir(path: str | Path) -> dict[str, Any]:
    """Sampling defaults from a Hugging Face folder's generation_config.json ({} if none)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    return _clean(data if isinstance(data, dict) else {}, _HF_KEYS)


def from_gguf_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling defaults from GGUF metadata (``general.sampling.*``; {} if none)."""
    return _clean(fields, _GGUF_KEYS)


def defaults_for(model_defaults: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The defaults a request starts from: fdx's chat defaults (for chat),
    overridden by the model's."""
    return {**(CHAT_DEFAULTS if chat else {}), **model_defaults}
