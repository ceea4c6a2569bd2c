"""The built-in weight formats (``model.quantization``): how the decoder
holds and multiplies its linear layers, embedding and LM head.

- ``none``: float32 (today's layout: linear weights as ``[in, out]``, the
  embedding as ``[vocab, hidden]`` and, when tied, a pre-transposed head
  copy). GGUF blocks are dequantized by the loader.
- ``auto``: each GGUF tensor in its own type (a file that mixes types
  loads as it is); float tensors stay float32.
- ``q8_0``, ``q4_0``, ``q4_1``, ``q4_k``, ``q6_k``: the layers' linear
  weights in that GGML type. A tensor the file holds in it is kept; any
  other (float32, or another block type) is quantized on load where the
  ``gguf`` package has a quantizer (q8_0, q4_0, q4_1). For q4_k and q6_k,
  which it cannot quantize to, a tensor in another block type is kept in
  its own (logged: Q4_K_M's Q6_K tensors under q4_k) and a float one is a
  config error naming it. Embedding and LM head stay as the file holds them.
- ``wint8`` / ``wint4``: the layers' linear weights quantized on load
  (FastDeploy's weight-only int8 per channel, int4 per group of
  ``group_size`` columns, setting ``plugins.weight_format.wint4.group_size``,
  default 128, halved until it divides the columns); embedding and LM head
  float32, as FastDeploy keeps them.

Products go through ``fdx.ops.quant.matmul`` (the compiled kernel the
backend's table passed for the kind, else the reference that dequantizes).
Fused q/k/v and gate/up (``fuse``): neighbours of one kind are one
row-concatenated weight; GGML parts of different kinds a ``BlockStack``,
multiplied in one compiled call (fdx.ops.parts: each activation row
quantized once for all its parts).
A row-parallel shard that would cut a block or group is held in float32
on that rank (logged), so tensor parallel runs on every file.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from fdx.model_io.loader import GGUFBlocks
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import LinearWeight, RowStack, WeightFormat

if TYPE_CHECKING:
    from paddle import Tensor

    from fdx.ops.quant import QuantizedTensor

log = logging.getLogger("fdx.models.weights")

GGML_KINDS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")
QUANTIZABLE = ("q8_0", "q4_0", "q4_1")       # kinds the gguf package can quantize to (on load)
WINT_KINDS = ("wint8", "wint4")              # fdx.ops.quant.WINT_KINDS (not imported here: see _quant)


@functools.cache
def _quant():
    """fdx.ops.quant, imported on first use: it loads Paddle, which a tensor
    parallel engine process (it only names and validates the format) never does."""
    from fdx.ops import quant
    return quant


@functools.cache
def _paddle():
    """Paddle, for the products that run once a linear a step: a cached
    module beats a function-level ``import paddle`` there (about 0.6 us a
    call, four a layer and the LM head); imported on first use, as _quant."""
    import paddle
    return paddle


@functools.cache
def _parts():
    """fdx.ops.parts (a fused weight's parts in one product), imported on first use, as _quant."""
    from fdx.ops import parts
    return parts


@functools.cache
def _dense():
    """fdx.ops.dense (the float32 products: compiled for a few rows, else
    Paddle's), imported on first use and cached, as _paddle."""
    from fdx.ops import dense
    return dense


# --- weights ---------------------------------------------------------------------------

class DenseWeight(LinearWeight):
    """float32 (or the model's dtype), stored as ``[in, out]``: eager Paddle
    on CPU multiplies that layout fastest (DESIGN.md), and so does the
    compiled product for a few rows (fdx.ops.dense)."""

    kind = "f32"

    def __init__(self, t: Tensor):
        self.t = t
        self.shape = (int(t.shape[1]), int(t.shape[0]))

    @classmethod
    def from_numpy(cls, w: np.ndarray) -> "DenseWeight":
        import paddle
        return cls(paddle.to_tensor(np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)))

    @property
    def dtype(self):
        return self.t.dtype

    @property
    def nbytes(self) -> int:
        return int(self.t.numel()) * self.t.element_size()

    def matmul(self, x: Tensor) -> Tensor:
        return _dense().matmul(x, self.t)

    def take_rows(self, index) -> "DenseWeight":
        import paddle
        return DenseWeight(paddle.to_tensor(np.ascontiguousarray(np.take(self.t.numpy(), index, axis=1))))

    def take_cols(self, start: int, stop: int) -> "DenseWeight":
        import paddle
        return DenseWeight(paddle.to_tensor(np.ascontiguousarray(self.t.numpy()[start:stop])))

    def dequantize(self) -> np.ndarray:
        return np.ascontiguousarray(self.t.astype("float32").numpy().T)

    def cast(self, dtype: str) -> "DenseWeight":
        return DenseWeight(self.t.astype(dtype))


class DenseTable(DenseWeight):
    """A float32 embedding table kept as ``[vocab, hidden]`` (rows gathered
    as they lie); ``matmul`` reads it transposed."""

    def __init__(self, t: Tensor):
        self.t = t
        self.shape = (int(t.shape[0]), int(t.shape[1]))

    @classmethod
    def from_numpy(cls, w: np.ndarray) -> "DenseTable":
        import paddle
        return cls(paddle.to_tensor(np.ascontiguousarray(w, dtype=np.float32)))

    def matmul(self, x: Tensor) -> Tensor:
        return _paddle().matmul(x, self.t, transpose_y=True)

    def embedding(self, ids: Tensor) -> Tensor:
        import paddle
        return paddle.gather(self.t, ids)

    def take_rows(self, index) -> "DenseTable":
        import paddle
        return DenseTable(paddle.to_tensor(np.ascontiguousarray(self.t.numpy()[np.asarray(index)])))

    def take_cols(self, start: int, stop: int) -> "DenseTable":
        import paddle
        return DenseTable(paddle.to_tensor(np.ascontiguousarray(self.t.numpy()[:, start:stop])))

    def dequantize(self) -> np.ndarray:
        return self.t.astype("float32").numpy()

    def cast(self, dtype: str) -> "DenseTable":
        return DenseTable(self.t.astype(dtype))


def take_cols(q: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    """Columns ``[start, stop)`` of a quantized weight, on whole blocks
    (groups for wint4) only: a slice of each row's bytes and scales."""
    if q.kind == "wint8":
        return _quant().QuantizedTensor("wint8", (q.shape[0], stop - start),
                                        np.ascontiguousarray(q.data[:, start:stop]), q.scales, 0)
    if q.kind == "wint4":
        g = q.group_size
        if start % g or stop % g:
            raise ValueError(f"wint4 groups of {g} columns would be cut")
        return _quant().QuantizedTensor("wint4", (q.shape[0], stop - start),
                                        np.ascontiguousarray(q.data[:, start // 2:stop // 2]),
                                        np.ascontiguousarray(q.scales[:, start // g:stop // g]), g)
    block, size = _quant().block_shape(q.kind)
    if start % block or stop % block:
        raise ValueError(f"{q.kind} blocks of {block} columns would be cut")
    return _quant().QuantizedTensor(q.kind, (q.shape[0], stop - start),
                                    np.ascontiguousarray(q.data[:, start // block * size:stop // block * size]))


class BlockWeight(LinearWeight):
    """A ``QuantizedTensor`` (GGUF blocks, wint8, wint4) kept as it is;
    products and row gathers through ``fdx.ops.quant``."""

    def __init__(self, q: QuantizedTensor):
        self.q, self.kind, self.shape = q, q.kind, tuple(q.shape)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def matmul(self, x: Tensor) -> Tensor:
        if x.dtype == _paddle().float32:
            return _quant().matmul(x, self.q)
        return _quant().matmul(x.astype("float32"), self.q).astype(x.dtype)

    def embedding(self, ids: Tensor) -> Tensor:
        return _quant().embedding(ids.numpy(), self.q)

    def take_rows(self, index) -> "BlockWeight":
        return BlockWeight(self.q.take_rows(np.asarray(index)))

    def take_cols(self, start: int, stop: int) -> "BlockWeight":
        return BlockWeight(take_cols(self.q, start, stop))

    def dequantize(self) -> np.ndarray:
        return self.q.dequantize()

    @staticmethod
    def concat(parts: Sequence["BlockWeight"]) -> "BlockWeight":
        """Same-kind weights stacked along rows: their bytes (and scales) concatenated."""
        qs = [p.q for p in parts]
        scales = None if qs[0].scales is None else np.concatenate([q.scales for q in qs])
        return BlockWeight(_quant().QuantizedTensor(qs[0].kind, (sum(q.shape[0] for q in qs), qs[0].shape[1]),
                                                    np.concatenate([q.plain_data() for q in qs]), scales,
                                                    qs[0].group_size))


class BlockStack(RowStack):
    """GGML-block weights of different kinds stacked along rows (a Q4_K_M
    q/k/v: q and k in Q4_K, v in Q6_K), made by ``stack``: multiplied in one
    compiled call where the kernel table has it (fdx.ops.parts: each
    activation row quantized once for all the parts), else part by part."""

    def matmul(self, x: Tensor) -> Tensor:
        if x.dtype == _paddle().float32:
            out = _parts().matmul(x, [p.q for p in self.parts])
            if out is not None:
                return out
        return super().matmul(x)

    def take_rows(self, index) -> LinearWeight:
        w = super().take_rows(index)
        return stack(w.parts) if isinstance(w, RowStack) else w

    def take_cols(self, start: int, stop: int) -> LinearWeight:
        return stack(super().take_cols(start, stop).parts)


def stack(parts: Sequence[LinearWeight]) -> LinearWeight:
    """Weights stacked along rows as one: neighbours of one block kind (and
    group) concatenated (rows are independent in GGML blocks), then one
    weight, a ``BlockStack`` of block weights, or a ``RowStack`` of anything else."""
    merged: list[LinearWeight] = []
    for p in parts:
        last = merged[-1] if merged else None
        if (isinstance(p, BlockWeight) and isinstance(last, BlockWeight) and last.kind == p.kind
                and last.q.group_size == p.q.group_size):
            merged[-1] = BlockWeight.concat([last, p])
        else:
            merged.append(p)
    if len(merged) == 1:
        return merged[0]
    return BlockStack(merged) if all(isinstance(p, BlockWeight) for p in merged) else RowStack(merged)


def weight_bytes(weights) -> dict[str, int]:
    """kind -> bytes held, over ``weights`` (LinearWeights and tensors)."""
    out: dict[str, int] = {}
    for w in weights:
        if w is None:
            continue
        kinds = w.kinds() if isinstance(w, RowStack) else (
            {w.kind: w.nbytes} if isinstance(w, LinearWeight) else
            {str(w.dtype).replace("paddle.", "").replace("float32", "f32"): int(w.numel()) * w.element_size()})
        for kind, n in kinds.items():
            out[kind] = out.get(kind, 0) + int(n)
    return out


# --- formats ------------------------------------------------------------------------------

def _quantized(tensor: Any) -> QuantizedTensor | None:
    """A file's block tensor as fdx.ops.quant's type (the same bytes), else None."""
    if isinstance(tensor, GGUFBlocks):
        return _quant().QuantizedTensor(tensor.kind, tuple(tensor.shape), tensor.data)
    return tensor if isinstance(tensor, _quant().QuantizedTensor) else None


def _float(tensor: Any) -> np.ndarray:
    q = _quantized(tensor)
    return q.dequantize() if q is not None else np.asarray(tensor, dtype=np.float32)


class _Format(WeightFormat):
    """What the built-ins share: float32 tables, same-kind fusing, and a
    float32 shard where a row-parallel split would cut blocks."""

    def dense(self, name: str, tensor: Any, role: str) -> LinearWeight:
        w = _float(tensor)
        return DenseTable.from_numpy(w) if role == "embedding" else DenseWeight.from_numpy(w)

    def blocks(self, name: str, tensor: Any) -> LinearWeight:
        """A file's block tensor kept in its type."""
        q = _quantized(tensor)
        try:
            _quant().ggml_type(q.kind)
        except ValueError:
            raise ValueError(f"config key 'model.quantization': weight {name!r} is in {q.kind}, "
                             "which fdx has no loader for") from None
        return BlockWeight(q)

    def fuse(self, parts: Sequence[LinearWeight]) -> LinearWeight:
        import paddle
        if len(parts) == 1:
            return parts[0]
        if all(type(p) is DenseWeight for p in parts):
            return DenseWeight(paddle.concat([p.t for p in parts], axis=1))
        return stack(parts)                   # one kind: one weight; mixed: a BlockStack (one call) or RowStack

    def tied_head(self, embedding: LinearWeight) -> LinearWeight:
        import paddle
        if isinstance(embedding, DenseTable):   # the fast layout: a pre-transposed copy (DESIGN.md)
            return DenseWeight(paddle.to_tensor(np.ascontiguousarray(embedding.t.numpy().T)))
        return embedding

    def shard_cols(self, name: str, weight: LinearWeight, start: int, stop: int) -> LinearWeight:
        try:
            return weight.take_cols(start, stop)
        except ValueError as e:
            log.info("weight %s (%s, %d columns) does not split at [%d, %d) (%s): this rank holds its "
                     "part in float32", name, weight.kind, weight.shape[1], start, stop, e)
            return DenseWeight.from_numpy(weight.dequantize()[:, start:stop])


class NoQuantization(_Format):
    """``none``: every weight float32 (GGUF blocks dequantized at load)."""
    name = "none"

    def load(self, name: str, tensor: Any, role: str) -> LinearWeight:
        return self.dense(name, tensor, role)


class AutoFormat(_Format):
    """``auto``: each GGUF tensor in the type the file stores it in.

    Setting ``without_kernel``: ``keep`` (default: a type with no compiled
    kernel in the backend's table is kept and multiplied by the reference
    product, which dequantizes per call: small memory, slow) or ``fp32``
    (such a tensor is dequantized at load: fast, larger). Either is logged
    once per type."""
    name = "auto"
    keeps_blocks = True

    def __init__(self, settings: dict | None = None, context=None):
        super().__init__(settings, context)
        self.without_kernel = self.settings.get("without_kernel", "keep")
        if self.without_kernel not in ("keep", "fp32"):
            raise ValueError(f"without_kernel must be keep or fp32, not {self.without_kernel!r}")
        self._logged: set[str] = set()

    def has_kernel(self, kind: str) -> bool:
        return any(self.kernels.usable(n) for n, _ in _quant().KERNELS.get(kind, ()))

    def load(self, name: str, tensor: Any, role: str) -> LinearWeight:
        if _quantized(tensor) is None:
            return self.dense(name, tensor, role)
        if not self.has_kernel(tensor.kind):
            fp32 = self.without_kernel == "fp32"
            if tensor.kind not in self._logged:
                self._logged.add(tensor.kind)
                log.info("%s: no compiled kernel in this backend's table: %s", tensor.kind,
                         "its tensors are dequantized to float32 at load" if fp32 else
                         "the reference product (dequantize per call) multiplies it")
            if fp32:
                return self.dense(name, tensor, role)
        return self.blocks(name, tensor)


class GgmlFormat(_Format):
    """One GGML block type for every linear weight of the layers."""
    keeps_blocks = True

    def __init__(self, settings: dict | None = None, context=None):
        super().__init__(settings, context)
        self._kept: set[str] = set()

    def load(self, name: str, tensor: Any, role: str) -> LinearWeight:
        kind, q = self.name, _quantized(tensor)
        if q is not None and (q.kind == kind or role != "linear"):
            return self.blocks(name, q)
        if role != "linear":
            return self.dense(name, tensor, role)
        held = "float32" if q is None else q.kind
        if kind not in QUANTIZABLE and q is not None:    # no quantizer: another block type stays as it is
            if q.kind not in self._kept:                 # (Q4_K_M's Q6_K tensors under q4_k)
                self._kept.add(q.kind)
                log.info("%s: %s tensors are kept in their own type (fdx cannot quantize to %s)", kind, q.kind, kind)
            return self.blocks(name, q)
        if kind not in QUANTIZABLE:
            raise ValueError(
                f"config key 'model.quantization': {kind}: weight {name!r} is {held} in the checkpoint and fdx "
                f"cannot quantize to {kind} on load (the gguf package has no {kind} quantizer); use a file "
                f"already in {kind}, auto, or one of {', '.join(QUANTIZABLE)}, wint8, wint4")
        w = _float(tensor)
        block, _ = _quant().block_shape(kind)
        if w.shape[1] % block:
            raise ValueError(f"config key 'model.quantization': {kind}: weight {name!r} has {w.shape[1]} "
                             f"columns, not a whole number of {block}-element blocks")
        from gguf.quants import quantize
        data = quantize(w, _quant().ggml_type(kind))
        return BlockWeight(_quant().QuantizedTensor(kind, tuple(w.shape), np.ascontiguousarray(data)))


class WintFormat(_Format):
    """Weight-only int8 / int4 of the layers' linear weights, quantized on
    load; embedding and LM head float32."""

    def __init__(self, settings: dict | None = None, context=None):
        super().__init__(settings, context)
        self.group_size = int(self.settings.get("group_size", 128))
        if self.group_size < 2 or self.group_size & (self.group_size - 1):
            raise ValueError(f"group_size must be a power of two of at least 2, not {self.group_size}")

    def load(self, name: str, tensor: Any, role: str) -> LinearWeight:
        if role != "linear":
            return self.dense(name, tensor, role)
        w = _float(tensor)
        if self.name == "wint8":
            return BlockWeight(_quant().quantize_wint8(w))
        g = self.group_size
        while w.shape[1] % g and g > 2:
            g //= 2
        if w.shape[1] % g:
            raise ValueError(f"config key 'model.quantization': wint4: weight {name!r} has {w.shape[1]} "
                             "columns, an odd number")
        return BlockWeight(_quant().quantize_wint4(w, g))


def _named(cls: type, name: str) -> type:
    return type(f"{name.upper()}Format", (cls,), {"name": name, "__doc__": f"``{name}``: {cls.__doc__}",
                                                  "__module__": __name__})


FORMATS: dict[str, type] = {"none": NoQuantization, "auto": AutoFormat,
                            **{k: _named(GgmlFormat, k) for k in GGML_KINDS},
                            **{k: _named(WintFormat, k) for k in WINT_KINDS}}


@hookimpl
def fdx_register_weight_formats(register):
    for name, cls in FORMATS.items():
        register(name, cls)
