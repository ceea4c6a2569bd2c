"""The built-in LoRA loader ``peft``: a PEFT adapter folder as
``peft.PeftModel.save_pretrained`` writes it, ``adapter_config.json`` and
``adapter_model.safetensors`` (contract: ``fdx.core.interfaces.LoRALoader``).

Read: ``r``, ``lora_alpha``, ``use_rslora`` (scale ``alpha / sqrt(r)``,
else ``alpha / r``) and every ``...layers.<i>.<self_attn|mlp>.<module>.lora_A``
/ ``lora_B`` weight. Refused with the reason (nothing of it is kept): a
missing or unreadable file, DoRA, bias training, ``modules_to_save``,
per-module rank or alpha patterns, ``fan_in_fan_out``, and any tensor that
is not a decoder layer's lora_A / lora_B (embedding or LM-head adapters)."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LoRALoader
from fdx.core.lora import LoRAWeights

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class PeftLoader(LoRALoader):
    name = "peft"

    def load(self, path: str) -> LoRAWeights:
        where = f"LoRA adapter {path}"
        if not os.path.isdir(path):
            raise ValueError(f"{where}: no such folder (a PEFT adapter is a folder with {CONFIG} and {WEIGHTS})")
        for f in (CONFIG, WEIGHTS):
            if not os.path.isfile(os.path.join(path, f)):
                raise ValueError(f"{where}: {f} is missing")
        try:
            with open(os.path.join(path, CONFIG)) as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{where}: {CONFIG} is not readable JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: {CONFIG} is not a JSON object")
        peft_type = cfg.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type {peft_type!r} is not LORA")
        for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
            if cfg.get(key, ok) != ok:
                raise ValueError(f"{where}: {CONFIG} sets {key}={cfg[key]!r}, which fdx does not support")
        if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
            raise ValueError(f"{where}: {CONFIG} trains biases (bias={cfg.get('bias')!r}), which fdx does "
                             "not support")
        for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
            if cfg.get(key):
                raise ValueError(f"{where}: {CONFIG} sets {key}, which fdx does not support")
        r, alpha = cfg.get("r"), cfg.get("lora_alpha")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: {CONFIG} 'r' must be a positive integer, not {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise ValueError(f"{where}: {CONFIG} 'lora_alpha' must be a number, not {alpha!r}")
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        try:
            from safetensors.numpy import load_file
            tensors = load_file(os.path.join(path, WEIGHTS))
        except Exception as e:
            raise ValueError(f"{where}: {WEIGHTS} is not a readable safetensors file: {e}") from None
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for key, t in tensors.items():
            m = _KEY.search(key)
            if m is None:
                raise ValueError(f"{where}: tensor {key!r} is not a decoder layer's lora_A / lora_B weight "
                                 "(embedding and LM-head adapters are not supported)")
            halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = np.asarray(t, dtype=np.float32)
        modules = {}
        for (layer, module), ab in sorted(halves.items()):
            if set(ab) != {"A", "B"}:
                missing = "lora_B" if "A" in ab else "lora_A"
                raise ValueError(f"{where}: layer {layer} {module} has no {missing} weight")
            modules[(layer, module)] = (ab["A"], ab["B"])
        return LoRAWeights(rank=r, scale=float(scale), modules=modules, source=path)


@hookimpl
def fdx_register_lora_loaders(register):
    register("peft", PeftLoader)
