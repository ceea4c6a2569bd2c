"""The fused decoder-layer port over an 8-bit KV cache (issue 34 item 5; csrc/decoder_layer.h
with csrc/kv8_kernels.h), and the q8_0 name of cache.kv_cache_dtype.

Kernel level, on the probes' mixed step (a prefill, a chunk over a cached context and two
decodes in one step) of tiny random layers: the compiled layer over int8 caches writes the
same cache bytes as the composed layer's int8 write (fdx_rope_write_kv8) and its output
matches the composed layer's (whose int8 attention is checked against float64 numpy in
tests/test_kv_int8.py); a stack of layers equals the layer calls bitwise. Engine level (the
tiny Llama checkpoint): the port takes int8 steps, and a batch equals each request alone
bitwise under backend.batch_invariant. Config: q8_0 is int8, bad combinations name the key.
"""
from __future__ import annotations

import gc

import numpy as np
import paddle
import pytest

from fdx import LLM, SamplingParams
from fdx.core import kernels
from fdx.core.config import ConfigError, FdxConfig
from fdx.ops import cpp, probes
from test_contracts import cpu_kernel_table
from test_decoder_layer import best_variant, random_case, run_stack, stack_case

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"compiled ops unavailable: {cpp.unavailable_reason()}")

KINDS = ("q8_0", "mixed-f32-extras")      # one GGML kind; mixed kinds with float32 parts, biases and q/k norms


def to_int8(cache: np.ndarray) -> np.ndarray:
    """A float32 cache [rows, D] quantized row by row by the compiled writer -> int8 [rows, D + 4]."""
    rows, d = cache.shape
    k = paddle.to_tensor(cache.reshape(rows, 1, d))
    kc = paddle.zeros([rows, d + 4], dtype="int8")
    vc = paddle.zeros([rows, d + 4], dtype="int8")
    cpp.kv8_write(k, k, paddle.to_tensor(np.arange(rows, dtype=np.int64)), kc, vc)
    return kc.numpy()


def fused(layer, x, residual, caches):
    """(out, residual, k cache, v cache) of cpp.decoder_layer over copies of int8 ``caches``."""
    from fdx.ops import attention
    f = layer.fused
    kc, vc = (paddle.to_tensor(c.copy()) for c in caches)
    meta = attention.build_attention_metadata(probes._QUERY_LENS, probes._CONTEXT_LENS, probes._TABLES,
                                              probes._BLOCK, f.num_kv_heads, kc.shape[0] // f.num_kv_heads,
                                              impl="cpp")
    builds = [[best_variant(probes_kind(p)) for p in parts] for parts in f.weights]
    out, res = cpp.decoder_layer(paddle.to_tensor(x), None if residual is None else paddle.to_tensor(residual),
                                 f.input_norm, f.post_norm, list(f.weights), builds, meta.positions,
                                 meta.slot_mapping, kc, vc, f.rope.cos_cache, f.rope.sin_cache, meta.cpp.seq_info,
                                 meta.cpp.block_tables, f.num_heads, f.num_kv_heads, f.head_dim, probes._BLOCK,
                                 f.rope.is_neox_style, f.eps, f.scale, f.biases, f.q_norm, f.k_norm)
    return out.numpy(), res.numpy(), kc.numpy(), vc.numpy()


def probes_kind(part) -> str:
    from fdx.plugins.backends.probe_child import part_kind
    return part_kind(part)


def composed(layer, x, residual, caches):
    """The layer's own ops over copies of int8 ``caches``, with the cpu attention backend (the
    compiled int8 write and attention) under the cpu kernel table."""
    from fdx.core.interfaces import AttentionContext
    from fdx.ops import attention
    from fdx.plugins.backends.attention import CpuAttention
    kc, vc = (paddle.to_tensor(c.copy()) for c in caches)
    kvh = layer.attn.num_kv_heads
    with kernels.using(cpu_kernel_table()):
        meta = attention.build_attention_metadata(probes._QUERY_LENS, probes._CONTEXT_LENS, probes._TABLES,
                                                  probes._BLOCK, kvh, kc.shape[0] // kvh, impl="cpp")
        out, res = layer(paddle.to_tensor(x), None if residual is None else paddle.to_tensor(residual),
                         meta.positions, (kc, vc), AttentionContext(CpuAttention(), meta))
    return out.numpy(), res.numpy(), kc.numpy(), vc.numpy()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("first", [True, False], ids=["first-layer", "with-residual"])
def test_fused_layer_over_int8_caches_equals_the_composed_int8_layer(kind, first):
    """The K/V the step writes: the same bytes (the same rotary kernel, then the same
    quantizer). The output: the same attention kernel over them, the products and norms as
    test_decoder_layer's fused-against-composed comparison (float32 rounding apart); an
    attention over the wrong rows, a misread scale or an unquantized row is off by far more."""
    layer, _, caches, x, residual = random_case(kind, 11)
    caches = [to_int8(c) for c in caches]
    got = fused(layer, x, None if first else residual, caches)
    want = composed(layer, x, None if first else residual, caches)
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])
    assert not np.array_equal(got[2], caches[0])                 # the step wrote its rows
    for g, w, part in zip(got[:2], want[:2], ("out", "residual")):
        err = float(np.abs(g - w).max()) / float(np.abs(w).max())
        assert err < 1e-4, f"{kind} {part}: max error {err:.3g} of the largest value"


@pytest.mark.parametrize("kind", KINDS)
def test_int8_stack_equals_the_layer_calls_bitwise(kind):
    layers, cfg, caches, x, meta, _ = stack_case(kind, 12, num_layers=3)
    caches = [[to_int8(c) for c in pair] for pair in caches]
    kv = [tuple(paddle.to_tensor(c.copy()) for c in pair) for pair in caches]
    out, res = run_stack(layers, x, meta, kv)
    want_x, want_res = x, None
    for layer, pair, (k, v) in zip(layers, caches, kv):
        want_x, want_res, want_k, want_v = fused(layer, want_x, want_res, pair)
        np.testing.assert_array_equal(k.numpy(), want_k)
        np.testing.assert_array_equal(v.numpy(), want_v)
    np.testing.assert_array_equal(out.numpy(), want_x)
    np.testing.assert_array_equal(res.numpy(), want_res)


def test_the_stack_refuses_mixed_or_misshapen_caches():
    layers, cfg, caches, x, meta, kv = stack_case("q8_0", 13, num_layers=2)
    fused_layers = [layer.fused for layer in layers]
    variants = [[[best_variant(probes_kind(p)) for p in parts] for parts in f.weights] for f in fused_layers]
    mixed = [kv[0], tuple(paddle.to_tensor(to_int8(c)) for c in caches[1])]
    with pytest.raises(ValueError, match="every cache float32"):
        cpp.stack_layers(fused_layers, variants, mixed)
    narrow = [tuple(paddle.zeros([c.shape[0], cfg.head_dim], dtype="int8") for c in pair) for pair in caches]
    with pytest.raises(ValueError, match=f"int8 \\[rows, {cfg.head_dim + 4}\\]"):
        cpp.stack_layers(fused_layers, variants, narrow)


# --- engine level -------------------------------------------------------------------------------

PROMPTS = [[5, 17, 300, 42, 9, 11, 8000], [7] * 23, list(range(100, 140)), [3, 4]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def _outs(llm, prompts):
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in out]


def test_engine_takes_the_fused_path_over_q8_0_and_a_batch_equals_each_request_alone(tiny_checkpoints,
                                                                                       monkeypatch):
    from fdx.ops import layer_port
    monkeypatch.setenv(layer_port.FUSED_LAYERS_ENV, "1")
    llm = LLM(str(tiny_checkpoints["LlamaForCausalLM"][0]), max_model_len=96, num_kv_blocks=64, block_size=4,
              progress=False, kv_cache_dtype="q8_0", max_num_batched_tokens=32, batch_invariant=True)
    try:
        assert llm.engine.config.cache.kv_cache_dtype == "int8" and llm.engine.kv_spec.dtype == "int8"
        layer_port._PORT._stack = None
        together = _outs(llm, PROMPTS)
        table = layer_port._PORT._stack
        assert table is not None and table[1] is not None and table[1].kv8     # the port ran over int8 caches
        alone = [_outs(llm, [p])[0] for p in PROMPTS]
        assert together == alone
        monkeypatch.setenv(layer_port.FUSED_LAYERS_ENV, "0")            # every layer composed: same tokens
        assert [t for t, _ in _outs(llm, PROMPTS)] == [t for t, _ in together]
    finally:
        llm.close()
        gc.collect()


# --- config -------------------------------------------------------------------------------------

def test_q8_0_is_the_int8_layout_and_the_cli_takes_it():
    from fdx.entrypoints.cli import build_parser
    from fdx.entrypoints.engine_args import _overrides
    assert FdxConfig.build(cache={"kv_cache_dtype": "q8_0"}).cache.kv_cache_dtype == "int8"
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "q8_0"])
    assert FdxConfig.build(**_overrides(args)).cache.kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype.*'auto', 'int8' or 'q8_0'"):
        FdxConfig.build(cache={"kv_cache_dtype": "q4_0"})


def test_q8_0_with_a_kv_connector_is_a_config_error_naming_the_key(tiny_checkpoints):
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_dtype.*kv_connector"):
        LLM(str(tiny_checkpoints["LlamaForCausalLM"][0]), max_model_len=64, num_kv_blocks=16, progress=False,
            kv_cache_dtype="q8_0", kv_connector="swap")


# --- fdx bench perplexity --kl-divergence ---------------------------------------------------------

def test_kl_divergence_perplexities_equal_the_engines_own_on_each_cache(tiny_checkpoints):
    """kv_divergence runs the model itself into a float32 and an int8 cache; its two
    perplexities must be what the engine's prompt logprobs give (fdx bench perplexity's
    measure, through the scheduler) with a float and with an int8 KV cache, on the same chunks
    at the same prefill chunking; the KL is 0 against itself and above 0 with int8."""
    import math

    from fdx.entrypoints.bench.perplexity import kv_divergence, perplexity
    path = str(tiny_checkpoints["LlamaForCausalLM"][0])
    ids = np.random.default_rng(4).integers(0, 1000, 100).tolist()
    kw = dict(max_model_len=40, num_kv_blocks=48, block_size=4, progress=False, max_num_batched_tokens=8)
    got = {}
    for dtype in ("auto", "int8"):
        llm = LLM(path, kv_cache_dtype=dtype, **kw)
        try:
            got[dtype] = (perplexity(llm, ids, ctx=32, bos=1)["perplexity"],
                          kv_divergence(llm, ids, ctx=32, bos=1, step=8))
        finally:
            llm.close()
    ppl_float, same = got["auto"]
    ppl_int8, r = got["int8"]
    assert same["kl_mean"] == 0 and same["top1_agree"] == 1 and same["perplexity"] == same["perplexity_reference"]
    assert r["tokens_scored"] == 3 * 15 and r["kv_cache_dtype"] == "int8"
    assert math.isclose(r["perplexity_reference"], ppl_float, rel_tol=1e-4)
    assert math.isclose(r["perplexity"], ppl_int8, rel_tol=1e-4)
    assert 0 < r["kl_mean"] < 0.05 and r["kl_max"] >= r["kl_p99"] >= 0
