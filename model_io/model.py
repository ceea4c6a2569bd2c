"""From config to a loaded model: the weight format ``model.quantization``
names, the checkpoint read as that format wants it, and the model class of
its architecture built over both. The engine and the tensor-parallel
workers build their model here, and nowhere else."""
from __future__ import annotations

import inspect
import logging
from typing import Any

from fdx.model_io.loader import Checkpoint, GGUFBlocks, load_checkpoint
from fdx.core.plugins import make_plugin, new_shape
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import BuildContext, Model, WeightFormat
from fdx.core.kernels import REFERENCE, KernelTable
from fdx.core.plugins import PluginError, PluginManager

log = logging.getLogger("fdx.checkpoint")

KEY = "model.quantization"


def weight_format(config: FdxConfig, plugins: PluginManager, kernels: KernelTable = REFERENCE) -> WeightFormat:
    """The weight format ``model.quantization`` names, constructed with the
    backend's kernel table and its ``plugins.weight_format.<name>``
    settings; a ConfigError naming the key when there is none or it
    refuses its settings."""
    name = config.model.quantization
    try:
        cls = plugins.get("weight_format", name)
    except PluginError as e:
        raise ConfigError(f"config key '{KEY}': {e}") from None
    return make_plugin(BuildContext(config, plugins, "weight_format", name, kernels=kernels), KEY, cls=cls)


def _takes_weight_format(cls: Any) -> bool:
    try:
        return "weight_format" in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def _release_library_pages(config: FdxConfig, when: str) -> None:
    """``backend.release_library_pages``: the shared libraries' start-up
    pages handed back to the kernel (core/host.py), so that the weights'
    peak does not stack on Paddle's import (issue 34 item 4)."""
    if not config.backend.release_library_pages:
        return
    from fdx.core.host import release_library_pages
    released = release_library_pages()
    if released:
        log.info("released %.1f MB of shared-library pages %s loading the model (backend.release_library_pages; "
                 "a page still used is read back on its next use)", released / 1e6, when)


def load_model(config: FdxConfig, plugins: PluginManager, kernels: KernelTable = REFERENCE,
               progress: bool = True, defer_tokenizer: bool = False) -> tuple[Any, Checkpoint]:
    """(model, checkpoint) for ``config.model``: the checkpoint keeps its
    config and tokenizer (``defer_tokenizer``: a DeferredTokenizer, see
    load_checkpoint), its weights now live in the model. A format's
    refusal of a tensor (a ValueError naming a config key) is a ConfigError."""
    fmt = weight_format(config, plugins, kernels)
    _release_library_pages(config, "before")
    ckpt = load_checkpoint(config.model.model, progress=progress, keep_blocks=fmt.keeps_blocks,
                           defer_tokenizer=defer_tokenizer)
    arch, cls = model_class(ckpt, plugins, config)

    def make(weight_format=None):
        return make_plugin(BuildContext(config, plugins, "model", arch, kernels=kernels, hf_config=ckpt.config,
                                        weights=ckpt.weights, weight_format=weight_format), "model.model", cls=cls)
    if cls.takes_weight_format if new_shape(cls) else _takes_weight_format(cls):
        model = make(fmt)
    elif config.model.quantization not in ("none", "auto"):
        raise ConfigError(f"config key '{KEY}': the model class {cls.__name__} ({arch}) takes float32 "
                          "weights only (Model.takes_weight_format is False, or its constructor has no weight_format "
                          "argument); use none or auto")
    else:               # auto, the default, is none for a class that takes float32 only
        if any(isinstance(w, GGUFBlocks) for w in ckpt.weights.values()):
            log.info("%s (%s) takes float32 weights only: model.quantization auto dequantizes the file's "
                     "blocks at load", cls.__name__, arch)
            ckpt.weights = {k: w.dequantize() if isinstance(w, GGUFBlocks) else w
                            for k, w in ckpt.weights.items()}
        model = make()
    if config.model.moe_router is not None:
        _set_moe_router(model, arch, config, plugins)
    ckpt.weights = {}
    from fdx.core.host import release_free_heap
    release_free_heap()                         # what the load freed, not kept resident
    _release_library_pages(config, "after")
    held = held_weight_bytes(model)
    if held:
        log.info("weights (%s): %s", fmt.describe(), format_bytes(held))
    return model, ckpt


def _set_moe_router(model: Any, arch: str, config: FdxConfig, plugins: PluginManager) -> None:
    """Put the router ``model.moe_router`` names in every MoE layer (here,
    where every tensor parallel rank builds its model too)."""
    name = config.model.moe_router
    if model.moe is None:
        raise ConfigError(f"config key 'model.moe_router': {arch} has no mixture-of-experts layers to route")
    try:
        cls = plugins.get("moe_router", name)
    except PluginError as e:
        raise ConfigError(f"config key 'model.moe_router': {e}") from None
    router = make_plugin(BuildContext(config, plugins, "moe_router", name, moe=model.moe), "model.moe_router", cls=cls)
    try:
        model.set_router(router)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"config key 'plugins.moe_router.{name}': {e}") from None


def check_model_class(cls: Any, arch: str, config: FdxConfig) -> None:
    """The class registered for ``arch`` implements the Model contract and
    can give what the config asks of it."""
    if not (isinstance(cls, type) and issubclass(cls, Model)):
        raise ConfigError(f"config key 'model.model': the class registered for the architecture {arch!r} "
                          f"({getattr(cls, '__qualname__', cls)!r}) does not subclass fdx.core.interfaces.Model")
    if config.model.task == "embed" and not cls.supports_pooling:
        raise ConfigError(f"config key 'model.task': embed needs a model that keeps its hidden states; "
                          f"{cls.__name__} ({arch}) does not (Model.supports_pooling is False)")
    if config.decoding.capture_hidden_states and not cls.supports_hidden_states:
        raise ConfigError(f"config key 'decoding.capture_hidden_states': the model {cls.__name__} ({arch}) "
                          "does not set last_hidden_states (Model.supports_hidden_states is False)")


def held_weight_bytes(model: Any) -> dict[str, int]:
    """kind -> bytes of weights ``model`` holds ({} for a model class that
    does not say: ``Model.weight_bytes`` returns {} by default)."""
    return dict(model.weight_bytes())


def format_bytes(by_kind: dict[str, int]) -> str:
    """'98.2 MB (q4_1 66.4, q8_0 30.1, f32 1.7)'."""
    total = sum(by_kind.values())
    parts = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
    return f"{total / 1e6:.1f} MB ({parts})"


def model_class(ckpt, plugins, config) -> tuple[str, type]:
    """(architecture name, its registered Model class) of a checkpoint, checked
    (check_model_class); ValueError naming the supported ones for another."""
    arch = (ckpt.config.get("architectures") or ["?"])[0]
    if arch not in plugins.names("model"):
        raise ValueError(f"unsupported architecture {arch!r} in {ckpt.path}; "
                         f"supported: {', '.join(plugins.names('model'))}")
    cls = plugins.get("model", arch)
    check_model_class(cls, arch, config)
    return arch, cls
