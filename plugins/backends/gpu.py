"""What the GPU backends share: probing Paddle's fused kernels at start-up.

A kernel counts as present only when one tiny call of it on the selected
device works: the Python wrappers in ``paddle.incubate.nn.functional``
exist in every build (the CPU wheel too), the device kernels do not. Each
backend probes the kernels it can use, uses the ones that work and falls
back to fdx's ops/ reference for the rest, logging the outcome once.

Which kernels are wired in today (see docs/backends.md):

- ``fused_rms_norm``: every RMS norm (``fdx.ops.norm``); the composed
  reference when it is missing.
- ``block_multihead_attention``, ``variable_length_memory_efficient_attention``,
  ``fused_rotary_position_embedding``: probed and reported; attention and
  rotary run the Paddle reference (``fdx.ops.attention``, ``fdx.ops.rotary``)
  until they are wired in and checked on a GPU.
"""
from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("fdx.backends.gpu")

_logged: set[tuple[str, str]] = set()


def _probe_rms_norm() -> None:
    import paddle
    import paddle.incubate.nn.functional as IF
    x = paddle.ones([2, 8], dtype="float32")
    out = IF.fused_rms_norm(x, paddle.ones([8], dtype="float32"), None, 1e-6, 1)[0]
    if not bool(paddle.allclose(out.astype("float32"), x).item()):
        raise RuntimeError("wrong result")


def _probe_rotary() -> None:
    import paddle
    import paddle.incubate.nn.functional as IF
    q = paddle.ones([1, 2, 1, 8], dtype="float32")
    IF.fused_rotary_position_embedding(q, None, None, use_neox_rotary_style=True)


def _probe_varlen() -> None:
    import paddle
    import paddle.incubate.nn.functional as IF
    q = paddle.ones([1, 1, 2, 8], dtype="float16")
    lens = paddle.to_tensor([[2]], dtype="int32")
    IF.variable_length_memory_efficient_attention(q, q, q, lens, lens, causal=True)


def _probe_block_attention() -> None:
    import paddle.incubate.nn.functional as IF
    if not callable(getattr(IF, "block_multihead_attention", None)):
        raise RuntimeError("not in this Paddle build")
    import paddle
    if not paddle.is_compiled_with_cuda():
        raise RuntimeError("needs a CUDA build")


PROBES: dict[str, Callable[[], None]] = {
    "fused_rms_norm": _probe_rms_norm,
    "fused_rotary_position_embedding": _probe_rotary,
    "variable_length_memory_efficient_attention": _probe_varlen,
    "block_multihead_attention": _probe_block_attention,
}
WIRED = ("fused_rms_norm",)     # kernels fdx calls when present; the rest are reported only


def probe_kernels(backend: str, names: tuple[str, ...]) -> dict[str, str | None]:
    """name -> None when the kernel ran on the current device, else why not.
    Switches fdx.ops to the reference where a wired kernel is missing and
    logs each outcome once per process."""
    from fdx.ops import norm
    found: dict[str, str | None] = {}
    for name in names:
        try:
            PROBES[name]()
            found[name] = None
        except Exception as e:                   # a missing kernel raises whatever the build raises
            found[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    norm.use_fused(found.get("fused_rms_norm", "not probed") is None)
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
    return found


def cast_model(model, dtype: str) -> None:
    """Cast a loaded model's weights to ``dtype`` (models with a ``cast`` method)."""
    if dtype == "float32":
        return
    cast = getattr(model, "cast", None)
    if cast is None:
        raise ValueError(f"the model {type(model).__name__} cannot run in {dtype} (it has no cast method)")
    cast(dtype)
