"""Model I/O: GGUF and Hugging Face checkpoints, the tokenizer and chat template.

It imports the engine's contracts, never the engine; the engine reaches it
through fdx.core.loading, where ``install_loader`` puts its loader (the
package root calls it). Its readers load when a model loads, not here:
``import fdx`` stays cheap (no numpy, no tokenizers).
"""
from __future__ import annotations

from fdx.core import loading


class CheckpointLoader:
    """The engine's ModelLoader over Hugging Face folders and GGUF files
    (fdx.model_io.model.load_model)."""

    def load_model(self, config, plugins, kernels, progress: bool = True, defer_tokenizer: bool = False):
        from fdx.model_io.model import load_model      # numpy, tokenizers: when a model loads
        return load_model(config, plugins, kernels, progress, defer_tokenizer)


def install_loader() -> None:
    """Make model I/O the engine's model loader (fdx.core.loading.install)."""
    loading.install(CheckpointLoader())
