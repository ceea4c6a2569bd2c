"""fdx: a plugin-based, modular LLM inference framework."""
import os as _os
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
