"""How the engine gets its model: the one seam between the engine and
model I/O (Hugging Face and GGUF checkpoints, the tokenizer and chat
template: fdx.model_io), which imports the engine's contracts and is
never imported by the engine.

Model I/O's ``ModelLoader`` is installed here by the package root
(fdx/__init__.py, the composition root, run before any fdx module):
every process that runs an engine (``LLM``, the serving engine process, a
tensor parallel worker, a test) has it. Another
loader (one that reads from a store of its own) is installed the same way
(``install``) and serves every engine built after.
"""
from __future__ import annotations

from typing import Any, Protocol


class ModelLoader(Protocol):
    """What the engine asks of model I/O."""

    def load_model(self, config: Any, plugins: Any, kernels: Any, progress: bool = True,
                   defer_tokenizer: bool = False) -> tuple[Any, Any]:
        """(model, checkpoint) for ``config.model``, built over the plugin
        manager's weight format and model class, over the backend's
        ``kernels``. The checkpoint keeps what the engine reads of it once
        the weights live in the model: ``config``, ``tokenizer`` (one that
        makes its own incremental detokenizer: ``tokenizer.detokenizer``;
        with ``defer_tokenizer``, built when first asked for more than its
        eos ids), ``path``, ``generation_config`` and ``is_default`` (the
        embedded default model). A ConfigError names the key at fault."""
        ...


_loader: ModelLoader | None = None


def install(loader: ModelLoader) -> None:
    """Make ``loader`` the engine's model loader (idempotent)."""
    global _loader
    _loader = loader


def model_loader() -> ModelLoader:
    """The installed model loader."""
    if _loader is None:
        raise RuntimeError("no model loader is installed (importing the fdx package installs model I/O's: "
                           "fdx/__init__.py)")
    return _loader
