"""KV sizing: the most the default KV cache may take (the engine gives it
what ``max_num_seqs`` sequences of ``max_model_len`` tokens need, up to
that). With a backend's ``total_memory_bytes`` (the CPU's: the host's
memory) it is ``cache.memory_fraction`` of that, the same on every start,
and nothing runs; without one, of what remains free after one forward at
the largest batch the config allows, its peak memory measured.

The forward runs over a throwaway KV cache just large enough for the
batch (allocated before the measurement, so it does not count). The
peak is the backend's to measure (``Backend.profile_peak_bytes``): the
device allocator's high-water mark on a GPU, the process's resident set
on the host (``host_peak_bytes`` here).

On the host the KV cache is reserved, not committed (``host_zeros``): its
tensors lie over anonymous memory the kernel maps on first write, so a
block's pages become resident when a sequence first writes it, and the
process holds what the running sequences use, not the whole cap (at the
1.7B size, 64 sequences of 1024 tokens capped at a tenth of 24 GB is
2.4 GB, of which one 1024-token sequence writes 384 MB).

After a step of many tokens (a prefill) the host hands back the heap pages
its activations left free (``release_step_heap``): glibc keeps them
resident otherwise, and the decode steps that follow never need them.
"""
from __future__ import annotations

import logging
import mmap
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fdx.core import kernels
from fdx.core.host import host_peak_bytes, malloc_trim, rss_bytes  # noqa: F401  (rss_bytes: re-exported)
from fdx.core.interfaces import AttentionContext, KVCacheSpec

log = logging.getLogger("fdx.memory")
MiB = 1 << 20


@dataclass(slots=True)
class KVBudget:
    free_bytes: int            # what the backend reports free after the profile forward
    peak_bytes: int            # extra memory that forward needed at its peak
    kv_bytes: int              # memory_fraction of what remains for the KV cache
    num_tokens: int            # the profiled batch
    num_seqs: int


_LAZY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


def host_zeros(shape, dtype: str = "float32"):
    """A zeroed host (CPU) Paddle tensor whose pages become resident only
    when written: numpy over an anonymous private mapping (zero-filled by
    the kernel on first touch), shared with Paddle through DLPack (no copy;
    the tensor keeps the mapping alive). ``paddle.zeros`` writes every page
    at once. A dtype numpy has no type for (bfloat16) falls back to it."""
    import paddle
    if dtype not in _LAZY_DTYPES:
        return paddle.zeros(shape, dtype=dtype)
    from paddle.utils.dlpack import from_dlpack
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return paddle.zeros(shape, dtype=dtype)
    dt = np.dtype(_LAZY_DTYPES[dtype])
    buf = mmap.mmap(-1, n * dt.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return from_dlpack(np.frombuffer(buf, dtype=dt).reshape(shape))


# From this many tokens in one step the step's freed activations go back to the system
# (malloc_trim). A 512-token prefill of the 1.7B shape (SmolLM2-1.7B, hidden 2048,
# intermediate 8192) left 69 MiB of freed float32 activations resident in glibc's heap,
# held through the decode steps after it (whose own buffers are a few hundred KiB); the
# trim costs milliseconds and the next prefill's first touch of those pages about as much,
# against the seconds such a step computes. Below it (decode, short prompts) nothing runs.
TRIM_AFTER_TOKENS = 256

# A decoder layer's MLP runs a long step's rows in chunks (fdx.plugins.models.layers.FeedForward):
# its gate/up product and SiLU output, [rows, 3 x intermediate] float32, are a step's largest
# activations (48 MiB at 512 rows of the 1.7B shape, SmolLM2-1.7B: intermediate 8192), and
# glibc's heap kept the holes they left between the layers' other buffers. A step of n rows
# runs in n // mlp_chunk_rows equal chunks (one below twice that): about MLP_CHUNK_BYTES of
# gate/up each, never fewer than MLP_CHUNK_MIN_ROWS rows (= fdx.ops.cpp.QUANT_BLAS_MIN_ROWS:
# a chunk's products take the many-row kernels the whole step's took, but where a kind turns
# to dequantize + BLAS above that: q5_0 from 512 rows on AVX-512 VNNI). A 512-token step of
# the 1.7B shape peaked 57 MiB lower (docs/benchmarks.md, "Resident memory") at the same CPU
# time; the embedded model's (intermediate 1536) is one chunk below 1364 rows.
MLP_CHUNK_BYTES = 8 << 20
MLP_CHUNK_MIN_ROWS = 128


def mlp_chunk_rows(intermediate: int) -> int:
    """The rows of one MLP chunk for an intermediate size (module note above)."""
    return max(MLP_CHUNK_MIN_ROWS, MLP_CHUNK_BYTES // (2 * intermediate * 4))


def release_step_heap(num_tokens: int) -> bool:
    """After a step of ``num_tokens`` tokens: from TRIM_AFTER_TOKENS, hand the
    allocator's free pages back to the system (glibc's ``malloc_trim``; no
    garbage collection: the activations are freed by reference counts). True
    if it trimmed."""
    if num_tokens < TRIM_AFTER_TOKENS:
        return False
    trim = malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


def profile_forward(model, attention, backend, spec: KVCacheSpec, num_tokens: int, num_seqs: int
                    ) -> Callable[[], None]:
    """A function that runs one prefill forward of ``num_tokens`` tokens in
    ``num_seqs`` sequences (logits for each one's last token) over a
    throwaway KV cache, allocated now."""
    import paddle
    block_size = spec.block_size
    seqs = max(1, min(num_seqs, num_tokens))
    lens = [num_tokens // seqs] * seqs
    lens[-1] += num_tokens - sum(lens)
    per_seq = [-(-n // block_size) for n in lens]
    spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, sum(per_seq), block_size, spec.dtype,
                       spec.layout)
    caches = backend.allocate_kv_cache(spec)
    starts = np.cumsum([0] + per_seq)
    tables = [list(range(int(starts[i]), int(starts[i + 1]))) for i in range(seqs)]
    with kernels.using(backend.kernels):           # the kernels the engine's steps will use
        meta = attention.build_metadata(lens, [0] * seqs, tables, spec,
                                        model.num_heads)
    ids = paddle.to_tensor(np.ones(num_tokens, dtype=np.int64))
    rows = paddle.to_tensor(np.cumsum(lens).astype(np.int64) - 1)

    def run() -> None:
        with paddle.no_grad(), kernels.using(backend.kernels):
            logits = model.forward(ids, meta.positions, caches, AttentionContext(attention, meta), rows)
        logits.numpy()                          # wait for the device
    return run


def kv_budget(backend, model, attention, spec: KVCacheSpec, num_tokens: int, num_seqs: int,
              memory_fraction: float) -> KVBudget:
    """Size the KV cache's memory: ``memory_fraction`` of the backend's total
    memory when it reports one (no forward: ``peak_bytes`` 0), else of what
    is free after one profiled forward at the given batch (KV laid out as
    ``spec``; its block count is ignored), less that forward's peak."""
    total = backend.total_memory_bytes()
    if total is not None:                       # a share of the whole memory: the same on every start
        # no profile forward: its figures changed nothing here, and at the largest batch it was the
        # load's high-water mark (1.1 GB above a 1.7B model for 2048 tokens: its throwaway KV cache
        # and the activations) and a minute and more of start-up
        free = int(backend.free_memory_bytes())
        kv = int(total * memory_fraction)
        log.info("KV sizing: the KV cache may take %.0f%% of the %.1f MiB of memory: %.1f MiB (reserved; "
                 "resident as sequences write it; %.1f MiB free now)",
                 memory_fraction * 100, total / MiB, kv / MiB, free / MiB)
        if kv > free:
            log.warning("KV sizing: %.1f MiB for the KV cache is more than the %.1f MiB free now; a full "
                        "cache would not fit: lower cache.memory_fraction or set cache.kv_cache_memory_bytes",
                        kv / MiB, free / MiB)
        return KVBudget(free, 0, kv, num_tokens, min(num_seqs, num_tokens))
    run = profile_forward(model, attention, backend, spec, num_tokens, num_seqs)
    peak = int(backend.profile_peak_bytes(run))
    del run                                     # the throwaway cache goes with it
    from fdx.core.host import release_free_heap
    release_free_heap()                         # the forward's freed activations, not kept resident
    free = int(backend.free_memory_bytes())
    kv = int(max(0, free - peak) * memory_fraction)     # the share is of what is free now
    log.info("KV sizing: a forward of %d tokens in %d sequences peaked %.1f MiB above the loaded model; "
             "%.1f MiB free; the KV cache may take %.0f%% of the %.1f MiB left: %.1f MiB",
             num_tokens, min(num_seqs, num_tokens), peak / MiB, free / MiB, memory_fraction * 100,
             max(0, free - peak) / MiB, kv / MiB)
    return KVBudget(free, peak, kv, num_tokens, min(num_seqs, num_tokens))
