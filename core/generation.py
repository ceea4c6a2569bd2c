"""Generation defaults: the model's own, then fdx's for chat.

A model may ship sampling defaults: Hugging Face's generation_config.json
(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens: the
keys vLLM reads) or a GGUF file's ``general.sampling.*`` metadata. They
apply wherever a request leaves the field unset, as in vLLM. Where the
model ships none, chat requests (``LLM.chat``, ``fdx chat``,
``/v1/chat/completions``) get fdx's chat defaults (``chat_defaults_for``):
``CHAT_DEFAULTS``, and for the embedded default model
``EMBEDDED_CHAT_DEFAULTS`` over them, measured for it. With the
SamplingParams defaults (temperature 1, 16 tokens) a small model's answer
is cut off or loops. Completions keep the SamplingParams / OpenAI defaults.
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

# fdx's chat defaults for the embedded default model (SmolLM2-135M-Instruct,
# Q4_1), measured with `fdx bench defaults` (docs/benchmarks.md): greedy,
# with penalties on generated tokens only. repetition_penalty also penalizes
# the prompt's words, and with it the model no longer answers "The capital
# of France is Paris." but starts in French (first sentences right: 44-56%
# against 67-72% without); sampling makes that first answer a coin toss
# (its first token: "The" 15%, "L" 14%, "La" 10%). Greedy alone loops in
# long answers; presence 1 and frequency 0.5 stop that (18 questions: 78%
# right, 72% in the first sentence; open prompts: no loops).
EMBEDDED_CHAT_DEFAULTS: dict[str, Any] = {"temperature": 0.0, "repetition_penalty": 1.0, "presence_penalty": 1.0,
                                          "frequency_penalty": 0.5}

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


def resolve(setting: str, model_defaults: dict[str, Any]) -> dict[str, Any]:
    """``model.generation_config`` applied (vLLM's ``--generation-config``):
    ``auto`` keeps the model's own defaults, ``vllm`` or ``none`` drops them
    (fdx's defaults apply), anything else is a folder whose
    generation_config.json is read instead."""
    if setting == "auto":
        return dict(model_defaults)
    if setting in ("vllm", "none"):
        return {}
    folder = Path(setting)
    if not (folder / "generation_config.json").is_file():
        raise ValueError(f"config key 'model.generation_config': {setting!r} is not auto, vllm, none or a "
                         "folder holding a generation_config.json")
    return from_hf_dir(folder)


def from_gguf_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Sampling defaults from GGUF metadata (``general.sampling.*``; {} if none)."""
    return _clean(fields, _GGUF_KEYS)


def chat_defaults_for(embedded: bool) -> dict[str, Any]:
    """fdx's chat defaults for a model: CHAT_DEFAULTS, with
    EMBEDDED_CHAT_DEFAULTS over them for the embedded default model
    (the checkpoint's ``is_default``)."""
    return {**CHAT_DEFAULTS, **(EMBEDDED_CHAT_DEFAULTS if embedded else {})}


def defaults_for(model_defaults: Mapping[str, Any], chat: bool,
                 chat_defaults: Mapping[str, Any] = CHAT_DEFAULTS) -> dict[str, Any]:
    """The defaults a request starts from: fdx's chat defaults for the model
    (for chat; ``chat_defaults_for``), overridden by the model's own."""
    return {**(chat_defaults if chat else {}), **model_defaults}
