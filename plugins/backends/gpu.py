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
    """Both rotary styles through the kernel, against fdx.ops.rotary's matmul form."""
    import numpy as np
    import paddle
    from fdx.ops import rotary
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 2, 8)).astype(np.float32))
    positions = paddle.to_tensor(np.array([0, 5, 2], dtype=np.int64))
    for neox in (True, False):
        rope = rotary.RotaryEmbedding(8, 16, 10000.0, is_neox_style=neox)
        rotary.use_fused(False)
        want = rope._apply(x, positions).numpy()
        rotary.use_fused(True)
        try:
            got = rope._apply(x, paddle.to_tensor(positions.numpy())).numpy()
        finally:
            rotary.use_fused(False)
        if not np.allclose(got, want, atol=1e-4):
            raise RuntimeError(f"wrong result ({'neox' if neox else 'GPT-J'} style)")


def _probe_varlen() -> None:
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


PROBES: dict[str, Callable[[], None]] = {
    "fused_rms_norm": _probe_rms_norm,
    "fused_rotary_position_embedding": _probe_rotary,
    "variable_length_memory_efficient_attention": _probe_varlen,
    "block_multihead_attention": _probe_block_attention,
}
WIRED = ("fused_rms_norm", "block_multihead_attention",    # fdx calls these when present; the rest are reported
         "fused_rotary_position_embedding")
AT_DTYPE = ("block_multihead_attention",)                 # probed at the model's dtype


def probe_kernels(backend: str, names: tuple[str, ...], dtype: str = "float16") -> dict[str, str | None]:
    """name -> None when the kernel ran on the current device (those in
    AT_DTYPE: at ``dtype``), else why not. Switches fdx.ops to the reference
    where a wired kernel is missing and logs each outcome once per process."""
    from fdx.ops import norm, rotary
    found: dict[str, str | None] = {}
    for name in names:
        try:
            PROBES[name](dtype) if name in AT_DTYPE else PROBES[name]()
            found[name] = None
        except Exception as e:                   # a missing kernel raises whatever the build raises
            found[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    norm.use_fused(found.get("fused_rms_norm", "not probed") is None)
    rotary.use_fused(found.get("fused_rotary_position_embedding", "not probed") is None)
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
    """Cast a loaded model's weights to ``dtype`` (models with a ``cast`` method)."""
    if dtype == "float32":
        return
    cast = getattr(model, "cast", None)
    if cast is None:
        raise ValueError(f"the model {type(model).__name__} cannot run in {dtype} (it has no cast method)")
    cast(dtype)
