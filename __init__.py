"""fdx: a plugin-based, modular LLM inference framework."""
import os as _os

# MKL reads this when Paddle loads it: its AVX-512 path on AMD (see DESIGN.md).
# Threads are set by the CPU backend (Paddle warns on import when
# OMP_NUM_THREADS > 1, and resets it to 1 when unset).
_os.environ.setdefault("MKL_DEBUG_CPU_TYPE", "7")

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
