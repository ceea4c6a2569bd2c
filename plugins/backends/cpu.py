"""The CPU backend: Paddle on the host, fp32, threads set to the cores we have.

Before the engine reports ready, ``setup`` builds or loads fdx's compiled
kernels (fdx.ops.cpp) and probes every kernel beyond plain Paddle math
that the CPU path may call (``KERNELS``) in a child process, each against
the composed reference (fdx.plugins.backends.probing; cached per host, so
a later start probes nothing). The table it installs decides what runs;
one log line says what was chosen and why.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from fdx.core import kernels
from fdx.core.hookspecs import hookimpl
from fdx.core.host import PORTABLE_ENV, available_cores, portable_kernels, proc_kib_field
from fdx.core.interfaces import Backend

log = logging.getLogger("fdx.backends.cpu")

# Paddle's fused kernels with a CPU build, and fdx's compiled ops (fdx.ops.probes has a probe for each).
PADDLE_KERNELS = ("fused_rms_norm", "swiglu", "fused_rotary_position_embedding")
# The quantized products: one name per kind and instruction-set build, the
# AVX-512 ones probed last (on a CPU without it each kills its probe child).
QUANT_KERNELS = tuple(f"cpp.{kind}_matmul{suffix}" for suffix in ("", ".avx2", ".avx512")
                      for kind in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "wint8", "wint4",
                                   "q2_k", "q3_k"))
# The per-machine layout choice of fdx.ops.quant.PROBED_REPACK_KINDS (interleaved where it measured faster).
LAYOUT_KERNELS = tuple(f"cpp.{kind}_interleave{suffix}" for suffix in ("", ".avx2", ".avx512")
                       for kind in ("q4_0", "wint4", "q2_k", "q3_k"))
# The float32 product for a few rows (fdx.ops.cpp.F32_KERNEL_NAMES), AVX-512 last likewise.
F32_KERNELS = ("cpp.f32_matmul", "cpp.f32_matmul.avx2", "cpp.f32_matmul.avx512")
# A mixture-of-experts layer's experts in one call (fdx.ops.moe.MOE_KERNEL_NAMES), AVX-512 last likewise.
MOE_KERNELS = ("cpp.moe_experts", "cpp.moe_experts.avx2", "cpp.moe_experts.avx512")
# A fused weight's parts in one product (fdx.ops.parts.PARTS_KERNEL_NAMES), AVX-512 last likewise.
PARTS_KERNELS = ("cpp.parts_matmul", "cpp.parts_matmul.avx2", "cpp.parts_matmul.avx512")
COMPILED_KERNELS = ("cpp.rms_norm", "cpp.add_rms_norm", "cpp.silu_and_mul", "cpp.paged_attention",
                    "cpp.rope_write_kv", "cpp.decoder_layer") + QUANT_KERNELS + LAYOUT_KERNELS + F32_KERNELS + MOE_KERNELS \
    + PARTS_KERNELS
KERNELS = PADDLE_KERNELS + COMPILED_KERNELS

_logged: set[str] = set()


def host_free_memory_bytes() -> int:
    free = proc_kib_field("/proc/meminfo", "MemAvailable")
    return 4 << 30 if free is None else free


def host_total_memory_bytes() -> int:
    """The host's memory (MemTotal), or this cgroup's limit when lower."""
    total = proc_kib_field("/proc/meminfo", "MemTotal") or 4 << 30
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def op_choices(table: kernels.KernelTable) -> dict[str, str]:
    """op -> what runs for it under ``table``, in words (the ops' own rules,
    fdx.ops.norm / activation / rotary / attention)."""
    from fdx.ops.cpp import f32_blas_min_rows, f32_build
    from fdx.ops.norm import CPP_MIN_ROWS

    def pick(*options: tuple[str, str], fallback: str) -> str:
        refused = []
        for name, label in options:
            if table.usable(name):
                return label + (f" ({'; '.join(refused)})" if refused else "")
            refused.append(f"{name}: {table.why_not(name)}")
        return f"{fallback} ({'; '.join(refused)})"

    if not table.usable("cpp.add_rms_norm"):
        norm = pick(("cpp.add_rms_norm", "compiled"), ("fused_rms_norm", "fused_rms_norm"), fallback="reference")
    elif table.usable("fused_rms_norm"):
        norm = f"compiled from {CPP_MIN_ROWS} rows, else fused_rms_norm"
    else:                       # fdx.ops.norm: the compiled kernel then takes every row count
        norm = f"compiled (fused_rms_norm: {table.why_not('fused_rms_norm')})"
    f32_rows = f32_blas_min_rows(f32_build(table))
    return {
        "rms_norm": norm,
        "silu_and_mul": pick(("cpp.silu_and_mul", "compiled"), ("swiglu", "swiglu"), fallback="reference"),
        "rotary": pick(("fused_rotary_position_embedding", "fused"), fallback="matmul"),
        "attention": pick(("cpp.paged_attention", "compiled"), fallback="paddle"),
        "rope_write_kv": pick(("cpp.rope_write_kv", "compiled"), fallback="composed"),
        "decoder_layer": pick(("cpp.decoder_layer", "compiled (GGML-block layers while their kinds' products are "
                                                    f"integer, float32 ones under {f32_rows} tokens a step)"),
                              fallback="composed"),
        "quant_matmul": quant_choices(table),
        "quant_layout": layout_choices(table),
    }


def layout_choices(table: kernels.KernelTable) -> str:
    """The weight layout of each kind whose layout is chosen per machine, for the
    build that runs it: ``q4_0=interleaved, wint4=plain (the plain layout is faster here ...)``."""
    from fdx.ops.cpp import quant_build
    from fdx.ops.quant import PROBED_REPACK_KINDS, interleave_chosen, interleave_kernel_name
    out = []
    with kernels.using(table):
        for kind in PROBED_REPACK_KINDS:
            build = quant_build(kind, table)
            why = "" if build is None or interleave_chosen(kind) else \
                f" ({table.why_not(interleave_kernel_name(kind, build))})"
            out.append(f"{kind}={'interleaved' if interleave_chosen(kind) else 'plain'}{why}")
    return ", ".join(out)


def quant_choices(table: kernels.KernelTable) -> str:
    """Which build of the quantized products runs, kinds with the same choice
    together: ``q8_0,q4_0,...=avx2 (avx512: SIGILL on this CPU)``."""
    by_choice: dict[str, list[str]] = {}
    for kind in dict.fromkeys(n.removeprefix("cpp.").split("_matmul")[0] for n in QUANT_KERNELS):
        refused, chosen = [], "reference"
        for suffix in (".avx512", ".avx2", ""):
            name = f"cpp.{kind}_matmul{suffix}"
            if table.usable(name):
                chosen = suffix.lstrip(".") or "portable"
                break
            refused.append(f"{suffix.lstrip('.') or 'portable'}: {table.why_not(name)}")
        label = chosen + (f" ({'; '.join(refused)})" if refused else "")
        by_choice.setdefault(label, []).append(kind)
    return " | ".join(f"{','.join(kinds)}={label}" for label, kinds in by_choice.items())


def probe_kernels(threads: int) -> kernels.KernelTable:
    """Build or load the compiled kernels, then the table of ``KERNELS`` for
    this host (cached; else probed in a child process)."""
    from fdx.ops import cpp
    from fdx.plugins.backends.probing import probe_table
    if "announced" not in _logged and not cpp.loaded():   # what runs now (the next lines: how long it took)
        _logged.add("announced")
        log.info("building or loading the compiled CPU kernels (a first build compiles for a minute or more)")
    cpp.prepare()
    if cpp.loaded():
        # FDX_PORTABLE_KERNELS: only the baseline build of the quantized products
        off = ({n: f"off ({PORTABLE_ENV})" for n in QUANT_KERNELS + F32_KERNELS + MOE_KERNELS + PARTS_KERNELS
                if "." in n[4:]}
               if portable_kernels() else {})
        return probe_table(list(KERNELS), threads, off, cpp.build_dir().name)
    why = cpp.unavailable_reason() or "unavailable"
    return probe_table(list(KERNELS), threads, {name: why for name in COMPILED_KERNELS})


class CpuBackend(Backend):
    name = "cpu"
    priority = 0
    attention_backend = "cpu"   # the compiled CPU kernel, Paddle fallback
    sampler = "host"
    model_runner = "default"
    dtypes = ("float32",)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def setup(self, config) -> None:
        threads = config.backend.num_threads or available_cores()
        # Paddle sets OMP_NUM_THREADS=1 on import; the OpenMP runtime reads
        # it when it starts (first parallel region, after this), and
        # set_num_threads sets MKL's and OpenMP's count directly.
        import paddle
        os.environ["OMP_NUM_THREADS"] = str(threads)
        paddle.set_device("cpu")
        paddle.base.core.set_num_threads(threads)
        self.num_threads = threads
        self.kernels = probe_kernels(threads)
        if config.backend.batch_invariant:      # the table carries it to the ops (fdx.core.kernels)
            self.kernels = dataclasses.replace(self.kernels, batch_invariant=True)
        from fdx.ops import cpp
        self.build_status = cpp.status()        # what the compiled-kernel build did
        self.kv_cache_setting = config.cache.kv_cache_dtype
        if self.kv_cache_setting == "int8" and not (self.kernels.usable("cpp.paged_attention") and cpp.loaded()):
            from fdx.core.config import ConfigError
            raise ConfigError(
                "config key 'cache.kv_cache_dtype': int8 needs the compiled CPU attention kernel, which is not in "
                f"use here ({self.kernels.why_not('cpp.paged_attention') or cpp.unavailable_reason() or 'off'}); "
                "use cache.kv_cache_dtype=auto")
        line = self.kernel_line()
        if line not in _logged:                 # once per process (tests and TP ranks build many engines)
            _logged.add(line)
            log.info("%s", line)

    def kernel_choices(self) -> dict[str, str]:
        return op_choices(self.kernels)

    def kernel_summary(self) -> str:
        """What the compiled-kernel build did, then the kernel line (under
        tensor parallel, rank 0's: the engine process builds and probes nothing)."""
        return "; ".join(filter(None, [getattr(self, "build_status", None), self.kernel_line()]))

    def kernel_line(self) -> str:
        t = self.kernels
        how = {"cache": f"probe table from the cache in {t.seconds:.1f} s",
               "probed": f"probed in a child process in {t.seconds:.1f} s"}.get(t.source, t.source)
        return "kernels: " + ", ".join(f"{op}={what}" for op, what in self.kernel_choices().items()) + f" ({how})"

    def free_memory_bytes(self) -> int:
        return host_free_memory_bytes()

    def total_memory_bytes(self) -> int:
        return host_total_memory_bytes()

    def kv_cache_dtype(self, model_dtype: str) -> str:
        """The model's dtype, or int8 under cache.kv_cache_dtype int8 (ops/csrc/kv8_kernels.h)."""
        return "int8" if getattr(self, "kv_cache_setting", "auto") == "int8" else model_dtype

    def allocate_kv_cache(self, spec) -> list:
        """Zeroed per-layer (k, v) tensors whose pages become resident when
        first written (core/memory.py host_zeros): the KV cache reserved at
        its cap, committed as sequences fill it."""
        from fdx.core.memory import host_zeros
        return [(host_zeros(spec.shape(), spec.dtype), host_zeros(spec.shape(), spec.dtype))
                for _ in range(spec.num_layers)]

    def row_invariant_rows(self, weight_kinds, head_dim: int | None = None) -> int | None:
        """fdx.ops.cpp.step_row_invariant_rows for these weight kinds with the probed
        table; None before setup or without the compiled kernels (the engine process
        under tensor parallel builds none)."""
        if not getattr(self, "num_threads", None):
            return None
        from fdx.ops import cpp
        return cpp.step_row_invariant_rows(weight_kinds, self.kernels, head_dim) if cpp.loaded() else None

    def describe(self) -> str:
        return f"cpu ({getattr(self, 'num_threads', '?')} threads, fp32)"


@hookimpl
def fdx_register_backends(register):
    register("cpu", CpuBackend)
