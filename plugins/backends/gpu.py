"""What the GPU backends share: probing Paddle's fused kernels at start-up.

A kernel counts as present only when one tiny call of it on the selected
device works: the Python wrappers in ``paddle.incubate.nn.functional``
exist in every build (the CPU wheel too), the device kernels do not. Each
backend probes the kernels it can use, uses the ones that work and falls
back to fdx's ops/ reference for the rest, logging the outcome once.

Which kernels are wired in today (see docs/backends.md):

- ``fused_rms_norm``: every RMS norm (``fdx.ops.norm``); the composed
  reference when it is missing.
- ``block_multihead_attention``: the ``paddle-block`` attention backend
  (plugins/backends/block_attention.py), which the cuda backend picks when
  the probe runs at the model's dtype; else ``paddle`` (the reference).
- ``fused_rotary_position_embedding``: full-width rotary (``fdx.ops.rotary``)
  when its probe matches the matmul form in both styles.
- ``variable_length_memory_efficient_attention``: probed and reported
  only; why it is not wired is in docs/backends.md.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

from fdx.core import kernels
from fdx.core.kernels import KernelTable

log = logging.getLogger("fdx.backends.gpu")

_logged: set[tuple[str, str]] = set()


# --- availability without loading Paddle ---------------------------------------------
# A tensor parallel engine process picks its backend (backend.name auto) but never loads Paddle
# (docs/benchmarks.md): where Paddle is not loaded yet and its installed build says "no", the
# GPU backends answer so without importing it. Loaded (TP 1, the device doubles of the tests),
# Paddle itself is asked.

def _paddle_dir() -> Path | None:
    spec = importlib.util.find_spec("paddle") if "paddle" not in sys.modules else None
    locations = getattr(spec, "submodule_search_locations", None) if spec is not None else None
    return Path(list(locations)[0]) if locations else None


def paddle_build_lacks_cuda() -> bool:
    """True when Paddle is not loaded and its build (``paddle/version``,
    read as text) was compiled without CUDA."""
    where = _paddle_dir()
    if where is None:
        return False
    try:
        text = (where / "version" / "__init__.py").read_text()
    except OSError:
        return False
    m = re.search(r"^cuda_version\s*=\s*'([^']*)'", text, re.M)
    return m is not None and m.group(1) in ("False", "")


def paddle_lacks_custom_devices() -> bool:
    """True when Paddle is not loaded and has no custom device plugin to
    load: ``CUSTOM_DEVICE_ROOT`` unset or empty and no ``paddle_custom_device``
    folder beside it (where Paddle looks, paddle/base/core.py)."""
    where = _paddle_dir()
    if where is None or os.environ.get("CUSTOM_DEVICE_ROOT"):
        return False
    plugins = where.parent / "paddle_custom_device"
    return not (plugins.is_dir() and any(plugins.glob("*.so")))


@kernels.implements("variable_length_memory_efficient_attention")
def _probe_varlen(dtype: str = "float16") -> None:
    import paddle
    import paddle.incubate.nn.functional as IF
    q = paddle.ones([1, 1, 2, 8], dtype="float16")
    lens = paddle.to_tensor([[2]], dtype="int32")
    IF.variable_length_memory_efficient_attention(q, q, q, lens, lens, causal=True)


def _probe_block_attention(dtype: str = "float16") -> None:
    """Two steps of one sequence (a 3-token prompt, then a decode) through
    the kernel at ``dtype``, checked against attention computed here."""
    import numpy as np
    import paddle
    import paddle.incubate.nn.functional as IF
    if not callable(getattr(IF, "block_multihead_attention", None)):
        raise RuntimeError("not in this Paddle build")
    from fdx.plugins.backends.block_attention import call_kernel, kernel_batch
    heads, kv_heads, d, bs = 2, 1, 64, 16
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((4, (heads + 2 * kv_heads) * d)).astype(np.float32)
    k_cache = paddle.zeros([2, kv_heads, bs, d], dtype=dtype)
    v_cache = paddle.zeros([2, kv_heads, bs, d], dtype=dtype)
    outs = [call_kernel(paddle.to_tensor(qkv[start:stop]).astype(dtype), k_cache, v_cache,
                        kernel_batch([stop - start], [start], [[1]]), bs).astype("float32").numpy()
            for start, stop in ((0, 3), (3, 4))]          # the prompt (context 0), then the decode (context 3)
    got = np.concatenate(outs).reshape(4, heads, d)
    q = qkv[:, :heads * d].reshape(4, heads, d)
    k, v = qkv[:, heads * d:(heads + 1) * d], qkv[:, (heads + 1) * d:]
    scores = np.einsum("thd,sd->hts", q, k) / np.sqrt(d) + np.triu(np.full((4, 4), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("hts,sd->thd", p / p.sum(-1, keepdims=True), v)
    if not np.allclose(got, want, atol=3e-2, rtol=3e-2):
        raise RuntimeError(f"wrong result at {dtype} (max error {np.abs(got - want).max():.3g})")


def _probes() -> dict[str, Callable[[str], None]]:
    from fdx.ops import probes
    return {**probes.PROBES, "variable_length_memory_efficient_attention": _probe_varlen,
            "block_multihead_attention": _probe_block_attention}
WIRED = ("fused_rms_norm", "block_multihead_attention",    # fdx calls these when present; the rest are reported
         "fused_rotary_position_embedding")
AT_DTYPE = ("block_multihead_attention",)                 # probed at the model's dtype (the rest at float32)


def probe_kernels(backend: str, names: tuple[str, ...], dtype: str = "float16") -> KernelTable:
    """The kernel table for ``names`` on the current device (those in
    AT_DTYPE probed at ``dtype``): name -> None when the kernel ran and
    matched the reference, else why not. Installs the table (the ops read
    it) and logs each outcome once per process. In this process, not a
    child: a GPU kernel that is missing raises, and a child would need a
    device context of its own."""
    from fdx.ops import probes
    every = _probes()
    t0 = time.perf_counter()
    found: dict[str, str | None] = {}
    for name in names:
        found.update(probes.run([name], dtype if name in AT_DTYPE else "float32", every))
    table = KernelTable(found, source="in-process", seconds=time.perf_counter() - t0)
    for name, why in found.items():
        key = (backend, f"{name}:{why is None}")
        if key in _logged:
            continue
        _logged.add(key)
        if why is None:
            log.info("%s: kernel %s present%s", backend, name, "" if name in WIRED else
                     " (not used yet: the Paddle reference runs)")
        else:
            log.warning("%s: kernel %s unavailable (%s): using the ops/ reference", backend, name, why)
    return table


def log_once(backend: str, message: str, level: int = logging.INFO) -> None:
    """Log ``message`` once per process for this backend."""
    key = (backend, message)
    if key not in _logged:
        _logged.add(key)
        log.log(level, "%s: %s", backend, message)


def model_dtype(backend, config) -> str:
    """The dtype the model will compute in (the engine resolves the same way)."""
    want = config.model.dtype
    return backend.dtypes[0] if want == "auto" else want


def cast_model(model, dtype: str) -> None:
    """Cast a loaded model's weights to ``dtype`` (``Model.cast``: the
    contract's default refuses anything but float32)."""
    if dtype != "float32":
        model.cast(dtype)
