"""fdx: a plugin-based, modular LLM inference framework."""
import os as _os
import warnings as _warnings

# MKL reads this when Paddle loads it: its AVX-512 path on AMD (see DESIGN.md).
# Threads are set by the CPU backend (Paddle warns on import when
# OMP_NUM_THREADS > 1, and resets it to 1 when unset).
_os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "7")

# `import paddle` warns that ccache is missing (it matters only to those
# compiling Paddle extensions repeatedly); keep it off users' terminals.
_warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy, absolute imports: `import fdx` stays cheap and never loads a
    # second copy of the core under the checkout folder's name.
    if name == "LLM":
        from fdx.core.llm import LLM
        return LLM
    if name == "SamplingParams":
        from fdx.core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
