"""fdx: a plugin-based, modular LLM inference framework."""
import os as _os
import sys as _sys
import warnings as _warnings



def _mkl_cpu_type() -> str | None:
    """MKL_DEBUG_CPU_TYPE for this CPU, or None to leave MKL alone.

    Paddle's bundled MKL (2019) dispatches on the vendor string: on AMD it
    takes a non-AVX path unless told the CPU type (7: AVX-512 when the CPU
    has it, 5: AVX2). On Intel it picks its best path by itself and the
    variable is only noise. Read once at import, before Paddle loads MKL
    (see DESIGN.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read(1 << 16)
    except OSError:
        return None
    if "AuthenticAMD" not in text:
        return None
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return "7" if " avx512f" in flags else "5" if " avx2" in flags else None


# Threads are set by the CPU backend (Paddle warns on import when
# OMP_NUM_THREADS > 1, and resets it to 1 when unset).
if "MKL_DEBUG_CPU_TYPE" not in _os.environ and (_cpu_type := _mkl_cpu_type()):
    _os.environ["MKL_DEBUG_CPU_TYPE"] = _cpu_type


class _NoTvmFfiWhilePaddleImports:
    """A meta-path finder that refuses `tvm_ffi` and `httpx._main` while
    Paddle is importing.

    Paddle 3.3's `import paddle` tries `import tvm_ffi` (to pick a DLPack
    exchange API; it falls back to the same capsule when that import fails,
    so nothing changes for Paddle), and tvm_ffi, installed with xgrammar,
    imports torch first thing. Every fdx process would then carry torch:
    about 190 MB resident and seconds of start-up (DESIGN.md: serving must
    not need torch). After Paddle is in, tvm_ffi imports as usual (xgrammar
    imports it, and torch, itself).

    Paddle also imports httpx (paddle.utils.download), whose package
    imports its command-line client when it can (`httpx._main`: click,
    rich, pygments, about 7 MB resident) and does without it when that
    import fails. No fdx process runs httpx's command line."""

    fdx_guard = True
    refused = {"tvm_ffi": "tvm_ffi (and torch with it)", "httpx._main": "httpx's command-line client"}

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name in cls.refused:
            paddle = _sys.modules.get("paddle")
            if paddle is not None and getattr(getattr(paddle, "__spec__", None), "_initializing", False):
                raise ImportError(f"fdx does not import {cls.refused[name]} while Paddle imports")
        return None


if not any(getattr(f, "fdx_guard", False) for f in _sys.meta_path):   # once, also under pytest's second name
    _sys.meta_path.insert(0, _NoTvmFfiWhilePaddleImports)

# `import paddle` warns that ccache is missing (it matters only to those
# compiling Paddle extensions repeatedly); keep it off users' terminals.
_warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

# The composition root: model I/O becomes the engine's model loader (core/loading.py; the
# engine imports no model I/O module). Cheap: its readers load with the first model.
from fdx.model_io import install_loader as _install_loader  # noqa: E402

_install_loader()

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams", "BeamSearchParams",
           "LoRARequest", "__version__"]


def __getattr__(name: str):
    # Lazy, absolute imports: `import fdx` stays cheap and never loads a
    # second copy of the core under the checkout folder's name.
    if name == "LLM":
        from fdx.core.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams", "GuidedDecodingParams"):
        from fdx.core import sampling_params
        return getattr(sampling_params, name)
    if name == "BeamSearchParams":
        from fdx.core.beam_search import BeamSearchParams
        return BeamSearchParams
    if name == "LoRARequest":
        from fdx.core.lora import LoRARequest
        return LoRARequest
    raise AttributeError(name)
