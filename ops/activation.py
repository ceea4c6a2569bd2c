"""Gated activations."""
import paddle
import paddle.nn.functional as F

__all__ = ["silu_and_mul"]


def silu_and_mul(x: paddle.Tensor) -> paddle.Tensor:
    """[N, 2I] -> [N, I]: silu(x[:, :I]) * x[:, I:] (one fused kernel)."""
    return F.swiglu(x)
