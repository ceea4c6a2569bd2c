"""``backend.model_runner: cuda-graph``: decode steps replayed from CUDA
graphs (the ``cuda-graph`` model runner; the deprecated
``backend.cuda_graph: true`` selects it). NEVER RUN ON A GPU: written from
Paddle's ``paddle.device.cuda.graphs.CUDAGraph`` API and tested only with
the capture and replay replaced by eager runs on the same static buffers
(tests/test_cuda_graph.py); treat it as experimental.

What it does. A step whose sequences all decode one token on a context
(no prompt tokens, no prompt logprobs), with at most
``max(plugins.model_runner.cuda-graph.batch_sizes)`` of them, is padded to the smallest
of those sizes that holds it. Each padded size has static input tensors
(token ids, positions, logits rows and the paddle-block kernel's metadata:
sequence lengths, offsets, block tables as wide as max_model_len needs)
and one graph, captured the first time a step of that size comes (after
one eager warm-up run on the same buffers). Later steps copy their values
into the buffers and replay. Padding rows are sequences with no context
and no encoder tokens, which the kernel's decoder skips (it returns early
for a sequence length of 0); their logits are dropped. Every other step
runs eagerly, as the default runner.

Why only paddle-block: the reference attention builds index tensors whose
shapes change every step; block_multihead_attention takes fixed-shape
metadata, and its two max lengths are host values read at launch: the
decoder bound is captured as max_model_len (launch sizing covers every
real length below it) and the encoder one as 0.

Requirements (``CudaGraphRunner.check_backend``, called when the backend is
chosen), each a ConfigError naming ``backend.model_runner``: the cuda
backend, a Paddle build whose ``is_cuda_graph_supported()`` is true, the
paddle-block attention (its kernel running at the model's dtype), and
tensor parallel off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from fdx.core.config import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import AttentionContext
from fdx.plugins.backends.block_attention import BlockAttentionMetadata, KernelBatch, PaddleBlockAttention
from fdx.plugins.backends.runner import DefaultModelRunner

if TYPE_CHECKING:
    import paddle

KEY = "config key 'backend.model_runner'"


def check_config(config, backend) -> None:
    """Make ``backend`` capture graphs, or raise a ConfigError saying why it cannot."""
    import paddle
    if backend.name != "cuda":
        raise ConfigError(f"{KEY}: the {backend.name} backend cannot capture CUDA graphs (only cuda can)")
    graphs = getattr(paddle.device.cuda, "graphs", None)
    supported = getattr(graphs, "is_cuda_graph_supported", None)
    if graphs is None or not hasattr(graphs, "CUDAGraph") or supported is None or not supported():
        raise ConfigError(f"{KEY}: this Paddle build ({paddle.__version__}) cannot capture CUDA graphs "
                          "(paddle.device.cuda.graphs.is_cuda_graph_supported() is false)")
    if backend.attention_backend != "paddle-block":
        raise ConfigError(f"{KEY}: needs the paddle-block attention, which needs block_multihead_attention at "
                          f"the model's dtype ({backend.kernels.why_not('block_multihead_attention')}); "
                          "the reference attention cannot be captured")
    if config.parallel.tensor_parallel_size > 1:
        raise ConfigError(f"{KEY}: not with parallel.tensor_parallel_size > 1")
    backend.model_runner = "cuda-graph"
    backend.captures_cuda_graphs = True


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured batch size that holds ``num_seqs`` (None: none does)."""
    fits = [s for s in sizes if s >= num_seqs]
    return min(fits) if fits else None


def padded_decode_batch(context_lens: list[int], tables: list[list[int]], size: int, width: int,
                        max_dec_len: int) -> dict[str, np.ndarray]:
    """The kernel's metadata for ``len(context_lens)`` decodes padded to
    ``size`` sequences (one token each; max_seq_len 1): int32 arrays by
    KernelBatch field name. Padding rows have no context (the decoder skips
    them) and block tables of -1."""
    n = len(context_lens)
    if not 0 < n <= size:
        raise ValueError(f"{n} decodes do not fit a batch of {size}")
    dec = np.zeros(size, dtype=np.int32)
    dec[:n] = context_lens
    bt = np.full((size, width), -1, dtype=np.int32)
    for i, t in enumerate(tables):
        if len(t) > width:
            raise ValueError(f"a block table of {len(t)} blocks is wider than the captured {width}")
        bt[i, :len(t)] = t
    ones = np.ones(size, dtype=np.int32)
    return dict(seq_lens_encoder=np.zeros(size, dtype=np.int32), seq_lens_decoder=dec, seq_lens_this_time=ones,
                padding_offsets=np.zeros(size, dtype=np.int32), cum_offsets=np.zeros(size, dtype=np.int32),
                cu_seqlens_q=np.arange(size + 1, dtype=np.int32), cu_seqlens_k=np.arange(size + 1, dtype=np.int32),
                block_tables=bt, max_dec_len=np.array([max_dec_len], dtype=np.int32))


@dataclass
class Graph:
    size: int
    ids: paddle.Tensor                  # int64 [size]
    positions: paddle.Tensor            # int64 [size]
    kernel: KernelBatch                 # its tensors are the static buffers
    rows: paddle.Tensor                 # int64 [size]: arange, logits of every row
    metadata: BlockAttentionMetadata
    graph: Any = None                   # paddle.device.cuda.graphs.CUDAGraph once captured
    logits: paddle.Tensor | None = None  # the captured output buffer


class CudaGraphSettings(BaseModel):
    """``plugins.model_runner.cuda-graph``."""
    model_config = ConfigDict(extra="forbid")
    batch_sizes: list[Annotated[int, Field(gt=0)]] = [1, 2, 4, 8, 16, 32]   # padded decode batch sizes
                                               # captured; a larger decode step runs eagerly


class CudaGraphRunner(DefaultModelRunner):
    Settings = CudaGraphSettings

    @classmethod
    def check_backend(cls, config, backend) -> None:
        check_config(config, backend)

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        ctx = self.ctx
        if not isinstance(ctx.attention, PaddleBlockAttention):
            raise ValueError("the cuda-graph runner needs the paddle-block attention")
        cfg = ctx.config
        sizes = (ctx.settings if isinstance(ctx.settings, CudaGraphSettings) else CudaGraphSettings()).batch_sizes
        self.sizes = sorted(s for s in set(sizes) if s <= cfg.scheduler.max_num_seqs)
        self.width = -(-cfg.model.max_model_len // self.spec.block_size)
        self.max_dec_len = cfg.model.max_model_len
        self.graphs: dict[int, Graph] = {}
        self.replayed = 0                   # steps served from a graph (for tests and logs)

    def _logits(self, input_ids, query_lens, context_lens, tables, rows):
        n = len(query_lens)
        size = bucket_for(n, self.sizes)
        if (size is None or any(q != 1 for q in query_lens) or not all(context_lens) or rows != list(range(n))
                or self.ctx.connector is not None       # a graph cannot call the per-layer connector hooks
                or self.step_activations is not None    # nor a request's activation hooks (eager: it sees them)
                or self.step_lora is not None):         # nor LoRA adapters' deltas
            return super()._logits(input_ids, query_lens, context_lens, tables, rows)
        g = self.graphs.get(size) or self._buffers(size)
        ids = np.zeros(size, dtype=np.int64)
        ids[:n] = input_ids
        pos = np.zeros(size, dtype=np.int64)
        pos[:n] = context_lens
        meta = padded_decode_batch(context_lens, tables, size, self.width, self.max_dec_len)
        _copy(g.ids, ids)
        _copy(g.positions, pos)
        for name, value in meta.items():
            if name != "max_dec_len":
                _copy(getattr(g.kernel, name), value)
        if g.graph is None:
            self.graphs[size] = g
            self._capture(g)
        logits = self._replay(g)
        self.replayed += 1
        return logits[:n].clone()

    def _buffers(self, size: int) -> Graph:
        import paddle
        meta = padded_decode_batch([1], [[0]], size, self.width, self.max_dec_len)
        cpu = paddle.CPUPlace()
        kernel = KernelBatch(
            num_tokens=size, **{k: paddle.to_tensor(v) for k, v in meta.items() if k != "max_dec_len"},
            max_enc_len_this_time=paddle.to_tensor(np.zeros(1, dtype=np.int32), place=cpu),
            max_dec_len_this_time=paddle.to_tensor(meta["max_dec_len"], place=cpu), max_seq_len=1)
        positions = paddle.zeros([size], dtype="int64")
        metadata = BlockAttentionMetadata(positions, size, kernel, None, None, None, None)
        return Graph(size, paddle.zeros([size], dtype="int64"), positions, kernel,
                     paddle.arange(size, dtype="int64"), metadata)

    def _run(self, g: Graph) -> paddle.Tensor:
        """The model on the static buffers. The rotary tables memoize by the
        positions tensor's identity, which stays the same here: forget them,
        so every run (and the capture) computes them from the buffer."""
        import paddle
        for layer in getattr(self.model, "layers", ()):
            rope = getattr(getattr(layer, "attn", None), "rope", None)
            if rope is not None and hasattr(rope, "_memo_positions"):
                rope._memo_positions = None
        with paddle.no_grad():
            return self.model.forward(g.ids, g.positions, self.ctx.kv_caches,
                                      AttentionContext(self.ctx.attention, g.metadata), g.rows)

    def _capture(self, g: Graph) -> None:
        """One eager warm-up run on this step's values, then the capture."""
        from paddle.device.cuda.graphs import CUDAGraph
        self._run(g)
        g.graph = CUDAGraph()
        g.graph.capture_begin()
        g.logits = self._run(g)
        g.graph.capture_end()

    def _replay(self, g: Graph) -> paddle.Tensor:
        g.graph.replay()
        return g.logits


def _copy(dst: paddle.Tensor, value: np.ndarray) -> None:
    """Write ``value`` into ``dst``'s memory (a captured graph reads that address)."""
    import paddle
    paddle.assign(paddle.to_tensor(value, dtype=dst.dtype), output=dst)


@hookimpl
def fdx_register_model_runners(register):
    register("cuda-graph", CudaGraphRunner)    # backend.model_runner: cuda-graph (cuda only)
