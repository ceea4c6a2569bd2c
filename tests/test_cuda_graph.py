"""``backend.model_runner: cuda-graph`` on the fake device layer: who may turn it on
(config errors naming the key), bucketing, and the cuda-graph runner's
padded static-buffer steps. CUDA graph capture and replay themselves need a
GPU and never ran: here ``_capture`` and ``_replay`` are replaced by eager
runs of the model on the same static buffers, so what is tested is the
padding, the buffer copies and the kernel metadata, not the graph."""
from __future__ import annotations

import paddle
import pytest

from fake_paddle_kernels import FakeBlockMultiheadAttention
from fdx import SamplingParams
from fdx.core.config import ConfigError
from fdx.plugins.backends.cuda_graph import CudaGraphRunner, bucket_for, padded_decode_batch
from test_contracts import GREEDY, FakeDevice, make_llm, prompts, token_ids, reference, tiny  # noqa: F401 (fixtures)


def graph_capable(monkeypatch, kernel=True):
    import paddle.incubate.nn.functional as IF
    FakeDevice(monkeypatch, "cuda")
    monkeypatch.setattr(paddle.device.cuda.graphs, "is_cuda_graph_supported", lambda: True)
    if kernel:
        monkeypatch.setattr(IF, "block_multihead_attention", FakeBlockMultiheadAttention(allow_float32=True))


def test_buckets():
    sizes = [1, 2, 4, 8]
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    meta = padded_decode_batch([7, 3], [[4, 5], [6]], 4, 3, 64)
    assert meta["seq_lens_decoder"].tolist() == [7, 3, 0, 0]            # padding rows: no context
    assert meta["seq_lens_this_time"].tolist() == [1, 1, 1, 1]
    assert meta["cu_seqlens_q"].tolist() == [0, 1, 2, 3, 4] and not meta["cum_offsets"].any()
    assert meta["block_tables"].tolist() == [[4, 5, -1], [6, -1, -1], [-1] * 3, [-1] * 3]
    with pytest.raises(ValueError, match="do not fit"):
        padded_decode_batch([1] * 5, [[0]] * 5, 4, 1, 64)


def test_backends_that_cannot_capture_say_so(tiny, monkeypatch):
    with pytest.raises(ConfigError, match=r"backend\.model_runner.*the cpu backend cannot capture CUDA graphs"):
        make_llm(tiny, cuda_graph=True)
    with monkeypatch.context() as m:
        FakeDevice(m, "iluvatar")
        with pytest.raises(ConfigError, match=r"backend\.model_runner.*the iluvatar backend cannot"):
            make_llm(tiny, dtype="float32", cuda_graph=True)
    with monkeypatch.context() as m:
        FakeDevice(m, "cuda")                      # this CPU wheel's graphs module: not supported
        with pytest.raises(ConfigError, match=r"backend\.model_runner.*this Paddle build .* cannot capture"):
            make_llm(tiny, dtype="float32", cuda_graph=True)
    with monkeypatch.context() as m:
        graph_capable(m, kernel=False)             # no block_multihead_attention: the reference attention
        with pytest.raises(ConfigError, match=r"backend\.model_runner.*needs the paddle-block attention"):
            make_llm(tiny, dtype="float32", cuda_graph=True)


def test_a_bad_batch_size_names_the_key(tiny):
    with pytest.raises(ConfigError, match=r"plugins\.model_runner\.cuda-graph\.batch_sizes\.0.*greater than 0"):
        make_llm(tiny, cuda_graph_batch_sizes=[0, 2])             # the deprecated key, checked at its new place


def test_decode_steps_run_padded_static_buffers(tiny, reference, monkeypatch):
    graph_capable(monkeypatch)
    monkeypatch.setattr(CudaGraphRunner, "_capture", lambda self, g: setattr(g, "graph", "not captured"))
    monkeypatch.setattr(CudaGraphRunner, "_replay", lambda self, g: self._run(g))
    llm = make_llm(tiny, dtype="float32", cuda_graph=True, cuda_graph_batch_sizes=[1, 2, 8])
    runner = llm.engine.runner
    assert isinstance(runner, CudaGraphRunner) and llm.engine.backend.captures_cuda_graphs
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference          # 4 decodes padded to 8
    solo = llm.generate(prompts()[:1], GREEDY)[0].outputs[0].token_ids      # 1 decode: size 1
    assert solo == reference[0]
    assert sorted(runner.graphs) == [1, 8] and runner.replayed > 0
    sp = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    eager = make_llm(tiny, dtype="float32").generate(prompts(), sp)         # the same, without graphs
    assert token_ids(llm.generate(prompts(), sp)) == token_ids(eager)
