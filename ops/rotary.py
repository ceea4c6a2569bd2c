"""Rotary position embedding (neox / GPT-J styles, optional partial rotary).

By default a matmul with a signed permutation (below). Where the backend's
probed table (``fdx.core.kernels``) says ``fused_rotary_position_embedding``
matched this reference in both styles, full-width rotary calls that Paddle
kernel instead, with the same cos/sin tables.
Beware Paddle's naming: its ``use_neox_rotary_style=True`` rotates
adjacent pairs (GPT-J style here), False rotates halves (neox here).
"""
import numpy as np
import paddle

from fdx.core import kernels

__all__ = ["RotaryEmbedding"]


def _rotation_matrix(head_dim: int, rotary_dim: int, is_neox_style: bool) -> np.ndarray:
    """R with x @ R == rotate_half(x) (neox) or rotate_every_two(x) (GPT-J) on
    the first rotary_dim dims and 0 on the rest."""
    r = np.zeros((head_dim, head_dim), np.float32)
    half = rotary_dim // 2
    for i in range(half):
        if is_neox_style:  # out[i] = -x[i + half], out[i + half] = x[i]
            r[i + half, i], r[i, i + half] = -1.0, 1.0
        else:  # out[2i] = -x[2i + 1], out[2i + 1] = x[2i]
            r[2 * i + 1, 2 * i], r[2 * i, 2 * i + 1] = -1.0, 1.0
    return r


class RotaryEmbedding:
    """out = x * cos + rotate(x) * sin over [N, heads, head_dim] tensors.

    Dims past rotary_dim pass through (cos 1, sin 0). rotate(x) is one small
    matmul with a signed permutation, cheaper than slicing and concatenating
    halves in eager Paddle. The per-token cos/sin, expanded to [N, heads, D],
    are memoized for the last `positions` tensor seen (by identity), so all
    layers of a step share them: pass a new positions tensor each step and
    never modify one in place.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        is_neox_style: bool = True,
        rotary_dim: int | None = None,
    ) -> None:
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        self.max_position, self.base, self.is_neox_style = max_position, base, is_neox_style

        inv_freq = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
        freqs = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)  # [P, rd/2]
        if is_neox_style:
            freqs = np.concatenate([freqs, freqs], axis=-1)
        else:
            freqs = np.repeat(freqs, 2, axis=-1)
        cos = np.ones((max_position, head_dim), np.float32)
        sin = np.zeros((max_position, head_dim), np.float32)
        cos[:, :rotary_dim], sin[:, :rotary_dim] = np.cos(freqs), np.sin(freqs)
        self.cos_cache = paddle.to_tensor(cos)  # [P, D]
        self.sin_cache = paddle.to_tensor(sin)
        self.rotation = paddle.to_tensor(_rotation_matrix(head_dim, rotary_dim, is_neox_style))
        self._memo_positions: paddle.Tensor | None = None
        self._memo: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}

    def cos_sin(self, positions: paddle.Tensor, num_heads: int) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Contiguous cos, sin of shape [N, num_heads, D] for these positions."""
        if positions is not self._memo_positions:
            self._memo_positions, self._memo = positions, {}
        if num_heads not in self._memo:
            n, d = positions.shape[0], self.head_dim
            cos = paddle.index_select(self.cos_cache, positions, axis=0)
            sin = paddle.index_select(self.sin_cache, positions, axis=0)
            # Pre-expanded: a broadcast multiply over the head axis is ~7x slower.
            self._memo[num_heads] = (
                cos.unsqueeze(1).expand([n, num_heads, d]).contiguous(),
                sin.unsqueeze(1).expand([n, num_heads, d]).contiguous(),
            )
        return self._memo[num_heads]

    def _apply(self, x: paddle.Tensor, positions: paddle.Tensor, impl: str | None = None) -> paddle.Tensor:
        """impl: "fused" (Paddle's kernel, full width only), "matmul", or None
        (the probed table decides)."""
        n, heads, d = x.shape
        if d != self.head_dim:
            raise ValueError(f"head_dim {d} != RotaryEmbedding head_dim {self.head_dim}")
        if impl is None:
            usable = kernels.active().usable("fused_rotary_position_embedding")
            impl = "fused" if usable and self.rotary_dim == d else "matmul"
        if impl == "fused":
            return self._fused(x, positions)
        cos, sin = self.cos_sin(positions, heads)
        rotated = paddle.matmul(x.reshape([n * heads, d]), self.rotation).reshape([n, heads, d])
        return x * cos + rotated * sin

    @kernels.implements("fused_rotary_position_embedding")
    def _fused(self, x: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        import paddle.incubate.nn.functional as IF
        n, heads, d = x.shape
        cos, sin = self.cos_sin(positions, 1)                       # [N, 1, D]
        out = IF.fused_rotary_position_embedding(
            x.reshape([1, n, heads, d]), None, None, sin=sin.reshape([1, n, 1, d]).astype(x.dtype),
            cos=cos.reshape([1, n, 1, d]).astype(x.dtype), use_neox_rotary_style=not self.is_neox_style)[0]
        return out.reshape([n, heads, d])

    def __call__(
        self, positions: paddle.Tensor, q: paddle.Tensor, k: paddle.Tensor
    ) -> tuple[paddle.Tensor, paddle.Tensor]:
        """positions int64 [N]; q [N, H, D]; k [N, KVH, D] -> rotated (q, k)."""
        return self._apply(q, positions), self._apply(k, positions)
