"""Model I/O: GGUF and Hugging Face checkpoints, the tokenizer and chat template.

Importing this package installs its model loader into the engine
(fdx.core.loading; the package root imports it). Its readers load when a
model loads, not here: ``import fdx`` stays cheap (no numpy, no tokenizers).
"""
from __future__ import annotations

from fdx.core import loading as _loading


class CheckpointLoader:
    """The engine's ModelLoader over Hugging Face directories and GGUF files
    (fdx.core.checkpoint.model.load_model)."""

    def load_model(self, config, plugins, kernels, progress: bool = True, defer_tokenizer: bool = False):
        from fdx.core.checkpoint.model import load_model      # numpy, tokenizers: when a model loads
        return load_model(config, plugins, kernels, progress, defer_tokenizer)


_loading.install(CheckpointLoader())
