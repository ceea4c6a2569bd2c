"""Parity on a real GPU (cuda or iluvatar): skipped where there is none,
which is everywhere fdx has been built so far; scripts/device_check.sh
runs it on a machine with the GPU build (docs/backends.md)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fdx import LLM, SamplingParams
from fdx.core.plugins import get_plugin_manager


def _gpu_backend() -> str | None:
    for name in ("cuda", "iluvatar"):
        if get_plugin_manager().get("backend", name).is_available():
            return name
    return None


BACKEND = _gpu_backend()
pytestmark = pytest.mark.skipif(BACKEND is None, reason="no GPU backend available here")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"]


def hf_greedy(model, ids, n, follow=None):
    from test_llm import hf_greedy as run
    return run(model, ids, n, follow)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_on_the_device_equals_transformers(arch, tiny_checkpoints):
    path, hf = tiny_checkpoints[arch]
    llm = LLM(str(path), backend=BACKEND, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8,
              progress=False)
    prompts = [np.random.default_rng(i).integers(3, 49152, n).tolist() for i, n in enumerate((5, 23))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(hf, p, 16, follow=t) for p, t in zip(prompts, got)]


@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_prompt_logprobs_close_to_transformers(arch, tiny_checkpoints):
    path, hf = tiny_checkpoints[arch]
    llm = LLM(str(path), backend=BACKEND, max_model_len=128, num_kv_blocks=64, block_size=8, progress=False)
    assert llm.engine.kv_spec.dtype in ("bfloat16", "float16")
    ids = np.random.default_rng(0).integers(3, 49152, 24).tolist()
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    got = [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]
    want = [ref[i, ids[i + 1]] for i in range(len(ids) - 1)]
    np.testing.assert_allclose(got, want, atol=0.15)


def test_profiled_kv_sizing_on_the_device(tiny_checkpoints):
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    llm = LLM(str(path), backend=BACKEND, max_model_len=128, memory_fraction=0.05, progress=False)
    b = llm.engine.kv_budget
    assert b.peak_bytes > 0 and b.free_bytes > b.peak_bytes


# --- the paths only a GPU runs: block_multihead_attention, the device sampler, CUDA graphs ---------

cuda_only = pytest.mark.skipif(BACKEND != "cuda", reason="needs the cuda backend")


def _half_dtypes():
    import paddle
    return ["float16"] + (["bfloat16"] if paddle.device.cuda.get_device_capability(0)[0] >= 8 else [])


@cuda_only
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 64), (8, 2, 128)])
def test_the_real_block_kernel_matches_the_host_double(heads, kv_heads, d):
    """What every fake-device test of paddle-block rests on: the double
    (tests/fake_paddle_kernels.py) computes what the real kernel computes,
    for fdx's calls (mixed prompt and decode steps, GQA, block tables)."""
    import paddle
    import paddle.incubate.nn.functional as IF
    from fake_paddle_kernels import REAL_BLOCK_MHA, FakeBlockMultiheadAttention
    from fdx.plugins.backends.block_attention import call_kernel, kernel_batch
    rng = np.random.default_rng(0)
    bs, tables = 16, [[3, 0], [2], [5, 1, 4]]
    for dtype in _half_dtypes():
        caches = {}
        for who in ("real", "double"):
            caches[who] = [paddle.zeros([6, kv_heads, bs, d], dtype=dtype) for _ in range(2)]
        steps = [([20, 9, 33], [0, 0, 0]), ([1, 1, 1], [20, 9, 33]), ([1, 1], [21, 10])]
        for lens, ctx in steps:
            x = rng.standard_normal((sum(lens), (heads + 2 * kv_heads) * d)).astype(np.float32)
            kb = kernel_batch(lens, ctx, tables[:len(lens)])
            IF.block_multihead_attention = REAL_BLOCK_MHA
            real = call_kernel(paddle.to_tensor(x).astype(dtype), *caches["real"], kb, bs)
            IF.block_multihead_attention = FakeBlockMultiheadAttention()
            try:
                fake = call_kernel(paddle.to_tensor(x).astype(dtype), *caches["double"], kb, bs)
            finally:
                IF.block_multihead_attention = REAL_BLOCK_MHA
            np.testing.assert_allclose(real.astype("float32").numpy(), fake.astype("float32").numpy(),
                                       atol=3e-2, rtol=3e-2, err_msg=f"{dtype} step {lens}/{ctx}")
        for r, f in zip(caches["real"], caches["double"]):
            np.testing.assert_allclose(r.astype("float32").numpy(), f.astype("float32").numpy(), atol=1e-2)


@cuda_only
def test_paddle_block_logprobs_close_to_the_reference_attention(tiny_checkpoints, monkeypatch):
    """Half precision, chunked prefill and prefix hits mix the kernel and the
    reference; prompt logprobs agree with the reference attention alone."""
    from fdx.plugins.backends import gpu
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    kw = dict(backend="cuda", max_model_len=128, num_kv_blocks=64, block_size=8, max_num_batched_tokens=16,
              kv_cache="prefix", progress=False)
    ids = np.random.default_rng(1).integers(3, 49152, 40).tolist()
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(llm):
        out = llm.generate([{"prompt_token_ids": ids}] * 2, sp)
        return [[next(iter(d.values())).logprob for d in o.prompt_logprobs[1:]] for o in out]
    block = LLM(str(path), **kw)
    assert block.engine.attention.name == "paddle-block"
    got = logprobs(block)
    monkeypatch.setitem(gpu.PROBES, "block_multihead_attention",
                        lambda dtype: (_ for _ in ()).throw(RuntimeError("forced off")))
    ref = LLM(str(path), **kw)
    assert ref.engine.attention.name == "paddle"
    np.testing.assert_allclose(got, logprobs(ref), atol=0.1)


@cuda_only
def test_cuda_graph_decodes_equal_eager_decodes(tiny_checkpoints):
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    kw = dict(backend="cuda", max_model_len=128, num_kv_blocks=64, block_size=8, progress=False)
    prompts = [{"prompt_token_ids": np.random.default_rng(i).integers(3, 49152, 7 + i).tolist()} for i in range(3)]
    eager = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, GREEDY)]
    llm = LLM(str(path), cuda_graph=True, cuda_graph_batch_sizes=[1, 2, 4], **kw)
    graphed = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.runner.replayed > 0 and graphed == eager


@cuda_only
def test_the_real_fused_rotary_matches_the_host_double():
    import paddle
    import paddle.incubate.nn.functional as IF
    from fake_paddle_kernels import REAL_FUSED_ROPE, FakeFusedRotary
    rng = np.random.default_rng(2)
    for dtype in ["float32", *_half_dtypes()]:
        x = paddle.to_tensor(rng.standard_normal((1, 5, 3, 64)).astype(np.float32)).astype(dtype)
        sin = paddle.to_tensor(rng.uniform(-1, 1, (1, 5, 1, 64)).astype(np.float32)).astype(dtype)
        cos = paddle.to_tensor(rng.uniform(-1, 1, (1, 5, 1, 64)).astype(np.float32)).astype(dtype)
        for style in (True, False):
            real = REAL_FUSED_ROPE(x, None, None, sin=sin, cos=cos, use_neox_rotary_style=style)[0]
            fake = FakeFusedRotary()(x, None, None, sin=sin, cos=cos, use_neox_rotary_style=style)[0]
            np.testing.assert_allclose(real.astype("float32").numpy(), fake.astype("float32").numpy(),
                                       atol=2e-2, err_msg=f"{dtype} use_neox_rotary_style={style}")
    assert IF.fused_rotary_position_embedding is REAL_FUSED_ROPE
