"""The compiled whole decoder layer (fdx.ops.cpp.decoder_layer, csrc/decoder_layer.h),
and the model-level kernel port that runs it (fdx.ops.layer_port), with a KV connector too.

One layer on random Q4_1 and Q8_0 blocks, float32 weights, and parts of
different kinds (a Q4_K_M-like q/k/v, gate/up; one with a float32 v beside
blocks) against a numpy layer written here
(gguf's dequantization of the same bytes, float64; the activations quantized
to int8 per block of 32 before each product, as the compiled products do:
fdx.ops.probes.int8_blocks) and against the layer's composed ops; then whole
models with ``quantization auto``, the fused path on and off
(FDX_FUSED_LAYERS), against transformers under batching, chunked prefill and
prefix hits (a Q4_K_M-like file of mixed kinds and a float32 one among
them), and the embedded SmolLM2 likewise (slow).
"""
from __future__ import annotations

import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core import kernels
from fdx.ops import cpp, probes
from fdx.ops.probes import act_block, int8_blocks
from fdx.plugins.backends.probe_child import (MIXED_LAYER, add_biases_and_qk_norms, part_kind, random_layer,
                                               run_layer)
from fdx.plugins.backends.attention import FUSED_LAYERS_ENV
from test_contracts import cpu_kernel_table
from test_llm import hf_greedy
from test_weight_formats import GREEDY, QUANT_TIE, TINY, check_greedy, files, prompts  # noqa: F401 (files: a fixture)
from torch_threads import one_torch_thread  # noqa: F401 (an autouse fixture: the references' torch on one thread)

pytestmark = pytest.mark.skipif(not cpp.available(), reason=f"compiled ops unavailable: {cpp.unavailable_reason()}")

KINDS = ("q4_1", "q8_0")
LAYERS = {"q4_1": "q4_1", "q8_0": "q8_0", "f32": "f32", "mixed": MIXED_LAYER,
          "mixed-f32": {**MIXED_LAYER, "v_proj": "f32", "up_proj": "f32"},
          # with a bias on each of the four weights and Qwen3's per-head q/k norms
          "q8_0-extras": "q8_0", "f32-extras": "f32", "mixed-f32-extras": {**MIXED_LAYER, "v_proj": "f32"}}
STACK_KINDS = ("q4_1", "q8_0", "f32", "mixed", "mixed-f32", "q8_0-extras", "f32-extras", "mixed-f32-extras")


def make_layer(name: str, rng):
    """random_layer of LAYERS[name], with biases and q/k norms for the "-extras" names."""
    layer, cfg = random_layer(LAYERS[name], rng)
    if name.endswith("-extras"):
        add_biases_and_qk_norms(layer, rng)
    return layer, cfg


def best_variant(kind: str) -> str:
    """This CPU's build of ``kind``'s product ("f32": the float32 one)."""
    table = cpu_kernel_table()
    if not table.usable("cpp.decoder_layer"):
        pytest.skip(f"cpp.decoder_layer: {table.why_not('cpp.decoder_layer')}")
    return next(v for v in cpp.QUANT_VARIANTS if table.usable(cpp.quant_kernel_name(kind, v)))


def numpy_layer(layer, cfg, x, residual, caches, margins=None, flip=None):
    """(out, residual, k cache, v cache) of the probes' mixed step, in numpy. ``margins``:
    a list that gets, per quantized product, rounding_margin of its activations; ``flip``:
    (product 0-3: qkv, o, gate/up, down; row, column), that activation rounded to int8 the
    other way (the other side of the boundary it is nearest)."""
    f = layer.fused
    # each weight's parts, stacked along rows: (float32 or not, [rows, cols] float64)
    wqkv, wo, wgu, wd = ([(part_kind(p) == "f32", p.numpy().T.astype(np.float64) if part_kind(p) == "f32"
                           else p.dequantize().astype(np.float64), act_block(part_kind(p))) for p in parts]
                         for parts in f.weights)
    in_w, post_w = f.input_norm.numpy().astype(np.float64), f.post_norm.numpy().astype(np.float64)
    h_, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b_qkv, b_o, b_gu, b_d = (0.0 if b is None else b.numpy().astype(np.float64) for b in f.biases)
    q_w, k_w = (None if t is None else t.numpy().astype(np.float64) for t in (f.q_norm, f.k_norm))

    def norm(v, w):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg.rms_norm_eps) * w

    calls = iter(range(4))

    def prod(v, w):   # a float32 part multiplies the activations as they are, a quantized one their int8 blocks
        call = next(calls)

        def blocks(blk):
            q = int8_blocks(v.astype(np.float32), blk).astype(np.float64)
            if margins is not None:
                margins.append(rounding_margin(v, blk))
            if flip is not None and flip[0] == call:
                row, col = flip[1:]
                b = v[row, col // blk * blk:(col // blk + 1) * blk].astype(np.float32)
                step = float(np.abs(b).max() / np.float32(127))
                scaled = float(v[row, col]) / step
                q[row, col] += step * (1.0 if scaled > np.rint(scaled) else -1.0)
            return q

        return np.concatenate([(v if dense else blocks(blk)) @ part.T for dense, part, blk in w], axis=1)

    def rope(v, pos, w=None):   # v [heads, D] at position pos (RMS-normed per head by w first), halves rotated
        if w is not None:
            v = norm(v, w)
        inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
        ang = np.concatenate([pos * inv, pos * inv])
        rot = np.concatenate([-v[:, d // 2:], v[:, :d // 2]], axis=1)
        return v * np.cos(ang) + rot * np.sin(ang)

    k_cache, v_cache = (c.astype(np.float64) for c in caches)
    num_slots = k_cache.shape[0] // kvh
    res = x.astype(np.float64) + (0 if residual is None else residual)
    qkv = prod(norm(res, in_w), wqkv) + b_qkv
    q_all = np.empty((len(x), h_, d))
    row, seqs = 0, []
    for qlen, ctx, table in zip(probes._QUERY_LENS, probes._CONTEXT_LENS, probes._TABLES):
        slots = [table[p // probes._BLOCK] * probes._BLOCK + p % probes._BLOCK for p in range(ctx + qlen)]
        for t in range(qlen):
            pos = ctx + t
            q, k, v = np.split(qkv[row + t], [h_ * d, (h_ + kvh) * d])
            q_all[row + t] = rope(q.reshape(h_, d), pos, q_w)
            k, v = rope(k.reshape(kvh, d), pos, k_w), v.reshape(kvh, d)
            for hh in range(kvh):
                k_cache[hh * num_slots + slots[pos]], v_cache[hh * num_slots + slots[pos]] = k[hh], v[hh]
        seqs.append((row, qlen, ctx, slots))
        row += qlen
    attn = np.empty_like(q_all)
    for start, qlen, ctx, slots in seqs:
        for t in range(qlen):
            for hh in range(h_):
                kv_rows = [(hh // (h_ // kvh)) * num_slots + s for s in slots[:ctx + t + 1]]
                scores = k_cache[kv_rows] @ q_all[start + t, hh] * d ** -0.5
                p = np.exp(scores - scores.max())
                attn[start + t, hh] = (p / p.sum()) @ v_cache[kv_rows]
    res = res + prod(attn.reshape(len(x), -1), wo) + b_o
    gu = prod(norm(res, post_w), wgu) + b_gu
    g, u = np.split(gu, 2, axis=1)
    out = prod(g / (1 + np.exp(-g)) * u, wd) + b_d
    return out, res, k_cache, v_cache


def rounding_margin(v, block: int) -> float:
    """How near the int8 rounding boundaries activations ``v`` [rows, cols] lie: the least
    distance of v / step from k + 1/2, relative to v / step (step: each block's
    max|v| / 127). The compiled paths compute an activation to a few float32 ulps of the
    float64 layer's (the products' float sums in another order, the norms in float32); one
    within that of a boundary may round the other way, a whole step of 1/127 of its block:
    legitimate, and through gate/up and SiLU more than these tolerances allow."""
    b = np.asarray(v, np.float64).reshape(len(v), -1, block)
    scaled = np.abs(b) / np.maximum(np.abs(b).max(axis=2, keepdims=True), 1e-30) * 127
    dist = np.abs(scaled - np.floor(scaled) - 0.5)
    return float(np.min(np.where(scaled > 0, dist / np.maximum(scaled, 1e-30), np.inf), initial=np.inf))


# The least rounding_margin the stack cases below take (about 8 float32 ulps): the
# q8_0 cases of seeds 5 and 8 had one activation 2-3 ulps from a boundary, and a
# kernel that sums its floats in another order (the few-row q8_0 VNNI tile) rounded
# it the other way (test_near_boundary_cases_differ_by_one_rounding_flip). Over seeds
# 0-39 of q8_0, q8_0-extras, q4_1 and mixed, the two tests below failed 1-4 seeds of a
# q8_0 kind with that tile and 1-3 of q8_0, q8_0-extras or mixed with main's kernels
# without it; none of the 69 seeds that keep MARGIN failed with either (2026-12-05).
MARGIN = 1e-6


def conditioned_stack_case(kind: str, seed: int, num_layers: int = 2):
    """stack_case of the first of seed, seed + 1000, ... whose float64 layer chain quantizes
    no activation within MARGIN of an int8 rounding boundary: what the stack is compared with
    then does not depend on a flip of float32 rounding."""
    for s in range(seed, seed + 30_000, 1000):
        case = stack_case(kind, s, num_layers)
        layers, cfg, caches, x = case[:4]
        margins, want_x, want_res = [], x, None
        for layer, pair in zip(layers, caches):
            want_x, want_res, _, _ = numpy_layer(layer, cfg, want_x, want_res, pair, margins)
        if min(margins, default=np.inf) >= MARGIN:
            return case
    raise AssertionError(f"{kind}: no seed from {seed} keeps its activations {MARGIN} from a rounding boundary")


def random_case(kind, seed: int):
    rng = np.random.default_rng(seed)
    layer, cfg = make_layer(kind, rng)
    caches = [rng.standard_normal((cfg.num_kv_heads * probes._BLOCKS * probes._BLOCK, cfg.head_dim)
                                  ).astype(np.float32) for _ in range(2)]
    n = sum(probes._QUERY_LENS)
    x = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
    return layer, cfg, caches, x, rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)


def assert_close(got, want, what: str, tol: float) -> None:
    for g, w, part in zip(got, want, ("out", "residual", "k cache", "v cache")):
        scale = float(np.abs(w).max())
        err = float(np.abs(g - w).max()) / scale
        assert err < tol, f"{what} {part}: max error {err:.3g} of the largest value"


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("first", [True, False], ids=["first-layer", "with-residual"])
def test_fused_layer_matches_numpy(kind, first):
    """Prefill over an empty context, a chunk over a cached one and two decodes
    in one step. An activation on an int8 rounding boundary may round the other
    way in float64 (one step of 1/127 of its block): 2e-3 of the largest
    output; a wrong head, position or slot, or a part in the wrong columns,
    is off by the whole value."""
    layer, cfg, caches, x, residual = random_case(kind, 1)
    assert layer.fused is not None
    assert [len(parts) for parts in layer.fused.weights] == (
        [2, 1, 2, 1] if kind.startswith("mixed") else [1, 1, 1, 1])
    assert (layer.fused.q_norm is not None) == all(b is not None for b in layer.fused.biases) == (
        kind.endswith("-extras"))
    got = run_layer(layer, x, None if first else residual, caches, "fused", best_variant)
    want = numpy_layer(layer, cfg, x, None if first else residual, caches)
    assert_close(got, want, kind, 2e-3)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_fused_layer_matches_the_composed_ops(kind):
    """The same kernels as the composed path's products (this CPU's build; MKL
    for float32 at these 15 rows), the rest composed in Paddle under the cpu
    table: float32 rounding apart."""
    layer, _, caches, x, residual = random_case(kind, 2)
    got = run_layer(layer, x, residual, caches, "fused", best_variant)
    with kernels.using(cpu_kernel_table()):
        want = run_layer(layer, x, residual, caches, "composed")
    assert_close(got, want, kind, 1e-4)


def test_layers_the_fused_path_leaves_to_the_composed_one():
    layer, *_ = random_case("q4_1", 3)
    assert layer.fused is not None
    layer.attn.reduce = lambda t: t           # a tensor-parallel split
    layer.weights_changed()
    assert layer.fused is None
    dense, _ = random_layer("q4_1", np.random.default_rng(4), table=kernels.REFERENCE)
    assert dense.fused is not None            # blocks kept even without a kernel: the backend decides per step
    from fdx.ops.quant import quantize_wint8
    from fdx.plugins.models.weight_formats import BlockWeight, DenseWeight
    dense.mlp.w_down = DenseWeight.from_numpy(np.zeros((128, 256), np.float32))
    dense.weights_changed()
    assert dense.fused is not None            # a float32 linear: fused too
    dense.mlp.w_down = dense.mlp.w_down.cast("bfloat16")
    dense.weights_changed()
    assert dense.fused is None                # another dtype
    dense.mlp.w_down = BlockWeight(quantize_wint8(np.zeros((128, 256), np.float32)))
    dense.weights_changed()
    assert dense.fused is None                # wint8


def random_layers(kind: str, rng, num_layers: int):
    """``num_layers`` random layers (LAYERS[kind]) sharing the first one's rotary table, and their config."""
    made = [make_layer(kind, rng) for _ in range(num_layers)]
    layers, cfg = [m[0] for m in made], made[0][1]
    for layer in layers[1:]:
        layer.attn.rope = layers[0].attn.rope
        layer.weights_changed()
    return layers, cfg


def stack_case(kind: str, seed: int, num_layers: int = 2):
    """``num_layers`` random layers (LAYERS[kind]) sharing one rotary table, their caches, x and the probes' step."""
    import paddle
    from fdx.ops import attention
    rng = np.random.default_rng(seed)
    layers, cfg = random_layers(kind, rng, num_layers)
    caches = [[rng.standard_normal((cfg.num_kv_heads * probes._BLOCKS * probes._BLOCK, cfg.head_dim)
                                   ).astype(np.float32) for _ in range(2)] for _ in layers]
    x = rng.standard_normal((sum(probes._QUERY_LENS), cfg.hidden_size)).astype(np.float32)
    meta = attention.build_attention_metadata(probes._QUERY_LENS, probes._CONTEXT_LENS, probes._TABLES,
                                              probes._BLOCK, cfg.num_kv_heads, caches[0][0].shape[0]
                                              // cfg.num_kv_heads, impl="cpp")
    kv = [tuple(paddle.to_tensor(c.copy()) for c in pair) for pair in caches]
    return layers, cfg, caches, x, meta, kv


def run_stack(layers, x, meta, kv, variant=best_variant):
    """One fdx_decoder_stack call; ``variant``: a function of each part's kind naming its build."""
    import paddle
    fused = [layer.fused for layer in layers]
    variants = [[[variant(part_kind(p)) for p in parts] for parts in f.weights] for f in fused]
    table = cpp.stack_layers(fused, variants, kv)
    return cpp.decoder_stack(paddle.to_tensor(x), table, meta.positions, meta.slot_mapping, meta.cpp.seq_info,
                             meta.cpp.block_tables, probes._BLOCK)


@pytest.mark.parametrize("kind", STACK_KINDS)
def test_decoder_stack_matches_numpy_layer_after_layer(kind):
    """Two layers in one fdx_decoder_stack call (the second reads and writes the
    first's output in place) against the numpy layer run twice, the first with
    no residual: outputs and every layer's caches. Each layer adds its own int8
    rounding flips (test_fused_layer_matches_numpy): twice that margin."""
    layers, cfg, caches, x, meta, kv = conditioned_stack_case(kind, 5)
    out, res = run_stack(layers, x, meta, kv)
    want_x, want_res = x, None
    for i, (layer, pair, (k, v)) in enumerate(zip(layers, caches, kv)):
        want_x, want_res, want_k, want_v = numpy_layer(layer, cfg, want_x, want_res, pair)
        assert_close((k.numpy(), v.numpy()), (want_k, want_v), f"{kind} caches of layer {i}", 4e-3)
    assert_close((out.numpy(), res.numpy()), (want_x, want_res), kind, 4e-3)


@pytest.mark.parametrize("kind", STACK_KINDS)
def test_decoder_stack_equals_the_layer_calls(kind):
    """The same kernels in the same order as decoder_layer once a layer (the same C call over
    a one-layer table, the residual carried in): equal bits."""
    layers, cfg, caches, x, meta, kv = stack_case(kind, 6, num_layers=3)
    out, res = run_stack(layers, x, meta, kv)
    want_x, want_res = x, None
    for layer, pair, (k, v) in zip(layers, caches, kv):
        want_x, want_res, want_k, want_v = run_layer(layer, want_x, want_res, pair, "fused", best_variant)
        np.testing.assert_array_equal(k.numpy(), want_k)
        np.testing.assert_array_equal(v.numpy(), want_v)
    np.testing.assert_array_equal(out.numpy(), want_x)
    np.testing.assert_array_equal(res.numpy(), want_res)


@pytest.mark.parametrize("kind", STACK_KINDS)
def test_decoder_stack_matches_the_composed_layers(kind):
    """The stack against each layer's composed ops one after another (Paddle
    attention, the cpu table's products): float32 rounding apart, as
    test_fused_layer_matches_the_composed_ops."""
    layers, cfg, caches, x, meta, kv = conditioned_stack_case(kind, 8, num_layers=2)
    out, res = run_stack(layers, x, meta, kv)
    want_x, want_res = x, None
    with kernels.using(cpu_kernel_table()):
        for layer, pair, (k, v) in zip(layers, caches, kv):
            want_x, want_res, want_k, want_v = run_layer(layer, want_x, want_res, pair, "composed")
            assert_close((k.numpy(), v.numpy()), (want_k, want_v), f"{kind} caches", 1e-4)
    assert_close((out.numpy(), res.numpy()), (want_x, want_res), kind, 1e-4)


@pytest.mark.parametrize("kind, seed, flip", [("q8_0-extras", 5, (2, 1, 113)), ("q8_0", 8, (3, 5, 167))],
                         ids=["gate-up-input", "down-input"])
def test_near_boundary_cases_differ_by_one_rounding_flip(kind, seed, flip):
    """The q8_0 stack cases the few-row q8_0 VNNI tile failed (seed 5 against numpy, 4.7e-3
    of the largest value; seed 8 against the composed layers, 9.2e-4) replayed: each has
    one activation 2-3 float32 ulps from an int8 rounding boundary (the gate/up input of
    token 1, column 113: 42.50001 steps; the down input of token 5, column 167: 24.500004),
    and the compiled layer and the composed one each equal the float64 layer with it
    rounded one way or the other, to float32 rounding: a legitimate flip, not a product's
    error (a wrong row, column, scale or tail matches neither)."""
    layers, cfg, caches, x, meta, kv = stack_case(kind, seed)
    margins = []
    plain = numpy_layer(layers[0], cfg, x, None, caches[0], margins)
    assert min(margins) < MARGIN / 2, "no longer near a boundary"
    flipped = numpy_layer(layers[0], cfg, x, None, caches[0], flip=flip)
    scale = float(np.abs(plain[0]).max())
    assert np.abs(plain[0] - flipped[0]).max() > 1e-4 * scale                 # the flip shows
    got = {"fused": run_layer(layers[0], x, None, caches[0], "fused", best_variant)}
    with kernels.using(cpu_kernel_table()):
        got["composed"] = run_layer(layers[0], x, None, caches[0], "composed")
    for impl, g in got.items():
        errs = [float(np.abs(g[0] - want[0]).max()) / scale for want in (plain, flipped)]
        assert min(errs) < 1e-5, f"{kind} seed {seed} {impl}: {errs} of the largest value from either rounding"
        for part, a, b in zip(("residual", "k cache", "v cache"), g[1:], plain[1:]):  # before the flip: as numpy
            assert np.abs(a - b).max() < 1e-5 * np.abs(b).max(), f"{kind} seed {seed} {impl} {part}"


class Recorder:
    """A KV connector's runner-side hooks: the calls in order, and at each save every
    layer's caches as they are then."""

    def __init__(self, kv):
        self.kv, self.calls, self.seen = kv, [], []

    def wait_for_layer_load(self, layer):
        self.calls.append(("wait", layer))

    def save_kv_layer(self, layer, kv_layer, meta):
        self.calls.append(("save", layer, kv_layer is self.kv[layer]))
        self.seen.append([(k.numpy().copy(), v.numpy().copy()) for k, v in self.kv])


def test_the_stack_runs_with_a_kv_connector_whose_hooks_see_each_layers_kv():
    """The kernel port (fdx.ops.layer_port) with a connector configured: the layers still
    run compiled, the connector's wait_for_layer_load(i) / save_kv_layer(i, layer i's KV)
    around each in order; at layer i's save its K/V are in the cache blocks (as they end)
    and the later layers' are not yet; outputs and caches bitwise those of the one call
    without a connector, and the composed layers' to float32 rounding."""
    import paddle
    from fdx.core.interfaces import AttentionContext
    from fdx.ops import layer_port
    from fdx.plugins.backends.attention import CpuAttention
    layers, cfg, caches, x, meta, kv = conditioned_stack_case("q8_0", 9, num_layers=3)
    plain_kv = [tuple(paddle.to_tensor(c.copy()) for c in pair) for pair in caches]
    fused = [layer.fused for layer in layers]
    rec = Recorder(kv)
    with kernels.using(cpu_kernel_table()):
        got = layer_port.decoder_stack(paddle.to_tensor(x), fused, kv, AttentionContext(CpuAttention(), meta, rec))
        plain = layer_port.decoder_stack(paddle.to_tensor(x), fused, plain_kv, AttentionContext(CpuAttention(), meta))
    assert got is not None and plain is not None
    assert rec.calls == [c for i in range(3) for c in (("wait", i), ("save", i, True))]
    for g, p in zip(got, plain):
        np.testing.assert_array_equal(g.numpy(), p.numpy())
    final = [(k.numpy(), v.numpy()) for k, v in kv]
    for (k, v), (pk, pv) in zip(final, plain_kv):
        np.testing.assert_array_equal(k, pk.numpy())
        np.testing.assert_array_equal(v, pv.numpy())
    for i, seen in enumerate(rec.seen):
        for j, ((k, v), (fk, fv), (ck, cv)) in enumerate(zip(seen, final, caches)):
            want = (fk, fv) if j <= i else (ck, cv)      # written up to layer i, the rest untouched
            np.testing.assert_array_equal(k, want[0])
            np.testing.assert_array_equal(v, want[1])
    want_x, want_res = x, None
    with kernels.using(cpu_kernel_table()):
        for layer, pair in zip(layers, caches):
            want_x, want_res, *_ = run_layer(layer, want_x, want_res, pair, "composed")
    assert_close([t.numpy() for t in got], (want_x, want_res), "with a connector", 1e-4)


@pytest.mark.slow
def test_a_real_connector_reloads_what_the_compiled_layers_wrote(files, monkeypatch):  # noqa: F811
    """End to end, Q8_0, fused layers on, the built-in swap connector (host memory tier)
    and no prefix cache: the compiled stack runs with the connector configured; the
    blocks it saves at each request's end are what the compiled layers wrote, since the
    second run loads them instead of computing them and gives the same greedy tokens,
    as the composed path (FDX_FUSED_LAYERS=0) does."""
    path, model = files["q8_0"]
    batch = [{"prompt_token_ids": p} for p in prompts(12, (21, 18, 9))]
    swap = {"plugins.connector.swap": {"max_blocks": 64}}
    monkeypatch.setenv(FUSED_LAYERS_ENV, "0")
    # batch_invariant: the second run computes only what the connector did not load, so its
    # steps have other row counts, and in the default mode a product's last bits may move
    # with the row count (the panel product from 16 rows); the claim here is about the blocks
    want = [o.outputs[0].token_ids for o in LLM(str(path), quantization="auto", batch_invariant=True,
                                                **TINY).generate(batch, GREEDY)]
    monkeypatch.setenv(FUSED_LAYERS_ENV, "1")
    spy = Spy(monkeypatch)
    llm = LLM(str(path), quantization="auto", kv_cache="paged", kv_connector="swap", batch_invariant=True,
              **swap, **TINY)
    first = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    again = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert spy.by_name["decoder_stack"] > 0, spy.by_name
    stats = llm.engine.connector.stats()
    assert stats["swap_saved_blocks"] > 0 and stats["swap_loaded_blocks"] >= 4, stats
    assert first == again == want


def test_decoder_stack_refuses_a_bad_step():
    """A slot outside the cache is an error before anything runs (no write out of bounds)."""
    import paddle
    layers, cfg, caches, x, meta, kv = stack_case("q8_0", 7)
    before = kv[0][0].numpy().copy()
    meta.slot_mapping = paddle.to_tensor(np.full(len(x), 10 ** 6, dtype=np.int64))
    with pytest.raises(ValueError, match="slot 1000000 outside the cache"):
        run_stack(layers, x, meta, kv)
    np.testing.assert_array_equal(kv[0][0].numpy(), before)


class Spy:
    """Counts the compiled layer's calls: one a layer (``decoder_layer``), or
    one a step for all of them (``decoder_stack``)."""

    def __init__(self, monkeypatch):
        self.by_name = {"decoder_layer": 0, "decoder_stack": 0}
        for name in self.by_name:
            monkeypatch.setattr(cpp, name, self.counted(name, getattr(cpp, name)))

    @property
    def calls(self) -> int:
        return sum(self.by_name.values())

    def counted(self, name, real):
        def call(*args, **kw):
            self.by_name[name] += 1
            return real(*args, **kw)
        return call


_SLOW = pytest.mark.slow    # pairwise: each file once fused and once composed, half of them in the quick subset


@pytest.mark.parametrize("name, fused", [
    ("q4_1", True), pytest.param("q4_1", False, marks=_SLOW), pytest.param("q8_0", True, marks=_SLOW),
    ("q8_0", False), ("mixed", True), pytest.param("mixed", False, marks=_SLOW),
    pytest.param("f32", True, marks=_SLOW), ("f32", False)])
def test_greedy_tokens_with_the_fused_path_on_and_off(files, name, fused, monkeypatch):  # noqa: F811
    """Tiny GGUF Llamas, ``auto``: greedy tokens follow transformers on the
    dequantized weights (test_weight_formats' margin) with the fused layers on
    or off, in a batch of three, then chunked (8 tokens a step) with prefix hits.
    "mixed" is like llama.cpp's Q4_K_M (q/k/v and gate/up of different kinds),
    "f32" all float32 (its decode steps under F32_BLAS_MIN_ROWS rows fuse).
    Fused, every file's small steps take the one call for all layers."""
    monkeypatch.setenv(FUSED_LAYERS_ENV, "1" if fused else "0")
    spy = Spy(monkeypatch)
    path, model = files[name]
    llm = LLM(str(path), quantization="auto", **TINY)
    check_greedy(llm, model, prompts(5))
    chunked = llm                             # the same model, its scheduling side swapped (one load, not two)
    chunked.engine.reconfigure(kv_cache="prefix", max_num_batched_tokens=8)
    shared = prompts(6, (24,))[0]
    check_greedy(chunked, model, [shared + [7, 8, 9]])
    check_greedy(chunked, model, [shared + [11], shared + [12, 13]])
    assert chunked.engine.kv_cache.stats()["prefix_cache_hits"] > 0
    llm.close()
    assert (spy.calls > 0) == fused
    assert (spy.by_name["decoder_stack"] > 0) == fused, spy.by_name


@pytest.mark.slow
def test_default_model_greedy_tokens_on_the_fused_path(hf_smollm_model, monkeypatch):
    """SmolLM2 Q4_1, ``auto``, fused (the default): a batch of three, then a
    long prompt and one that hits its prefix, chunked (8 tokens a step):
    greedy tokens equal transformers on the file's dequantized weights at
    test_weight_formats' margin. The composed path on the real file was
    dropped (pairwise): every GGUF kind, Q4_1 among them, runs composed and
    fused on the tiny files above."""
    monkeypatch.setenv(FUSED_LAYERS_ENV, "1")
    spy = Spy(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    chunked = LLM(quantization="auto", max_model_len=256, num_kv_blocks=64, block_size=16, kv_cache="prefix",
                  max_num_batched_tokens=8, progress=False)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
    batch = [chunked.tokenizer.encode(t) for t in texts]
    shared = batch[2] * 3                     # over two blocks of 16: the second request hits them
    for prompts_ in (batch, [shared], [shared + batch[0]]):
        outs = chunked.generate([{"prompt_token_ids": p} for p in prompts_], params)
        for p, out in zip(prompts_, outs):
            got = out.outputs[0].token_ids
            assert got == hf_greedy(hf_smollm_model, p, 16, follow=got, rel_tie=QUANT_TIE), p
    assert chunked.engine.kv_cache.stats()["prefix_cache_hits"] > 0
    chunked.close()
    assert spy.calls > 0


# A step past QUANT_BLAS_MIN_ROWS (128) rows within the random layers' 64 rotary positions: a
# 60-token prompt, chunks of 50 and 45 tokens over 10 and 15 cached ones and a decode, 16-slot
# blocks (the slots of each sequence scattered over the cache).
LONG_QUERY_LENS, LONG_CONTEXT_LENS, LONG_BLOCK = [60, 50, 45, 1], [0, 10, 15, 40], 16
LONG_TABLES = [[3, 17, 0, 9], [12, 5, 1, 14], [7, 19, 2, 11], [6, 15, 8]]


def long_step(kind: str, seed: int, num_layers: int = 2):
    """``num_layers`` random layers (LAYERS[kind]) sharing a rotary table, their float32 caches (random
    where nothing is written), x and the cpu backend's metadata of the long step."""
    import paddle
    from fdx.core.interfaces import AttentionContext
    from fdx.ops import attention
    from fdx.plugins.backends.attention import CpuAttention
    rng = np.random.default_rng(seed)
    layers, cfg = random_layers(kind, rng, num_layers)
    slots = 20 * LONG_BLOCK
    caches = [[rng.standard_normal((cfg.num_kv_heads * slots, cfg.head_dim)).astype(np.float32) for _ in range(2)]
              for _ in layers]
    x = rng.standard_normal((sum(LONG_QUERY_LENS), cfg.hidden_size)).astype(np.float32)
    with kernels.using(cpu_kernel_table()):
        meta = attention.build_attention_metadata(LONG_QUERY_LENS, LONG_CONTEXT_LENS, LONG_TABLES, LONG_BLOCK,
                                                  cfg.num_kv_heads, slots, impl="cpp")
    kv = lambda: [tuple(paddle.to_tensor(c.copy()) for c in pair) for pair in caches]  # noqa: E731
    return layers, cfg, x, AttentionContext(CpuAttention(), meta), kv


def blas_at(layers, rows: int) -> bool:
    """Whether a GGML-block part of ``layers`` is multiplied by dequantize + BLAS at ``rows`` on the composed path."""
    for layer in layers:
        for parts in layer.fused.weights:
            for p in parts:
                kind = part_kind(p)
                if kind != "f32":
                    least = cpp.quant_blas_min_rows(kind, best_variant(kind))
                    if least is not None and rows >= least:
                        return True
    return False


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "mixed", "q8_0-extras"])
def test_the_port_takes_a_prefill_of_many_rows_with_the_composed_bits(kind):
    """A 156-row step (past QUANT_BLAS_MIN_ROWS, which the port once refused outright) runs
    compiled whenever every GGML-block part's composed product at that row count is its
    integer kernel (on AVX-512 VNNI: every kind here), and gives the composed layers' bits:
    the same kernels (products, norms, rotary + KV write, attention, SiLU) in the same
    order, no float32 rounding between them that the composed ops round otherwise."""
    import paddle
    from fdx.ops import layer_port
    layers, cfg, x, ctx, kv = long_step(kind, 11)
    rows = sum(LONG_QUERY_LENS)
    assert rows >= cpp.QUANT_BLAS_MIN_ROWS
    with kernels.using(cpu_kernel_table()):
        fused_kv = kv()
        got = layer_port.decoder_stack(paddle.to_tensor(x), [layer.fused for layer in layers], fused_kv, ctx)
        if blas_at(layers, rows):
            assert got is None              # a kind dequantized from here on this CPU: the composed layers
            pytest.skip(f"{kind}: dequantize + BLAS at {rows} rows on this CPU")
        assert got is not None
        want_kv = kv()
        want_x, want_res = paddle.to_tensor(x), None
        for layer, pair in zip(layers, want_kv):
            want_x, want_res = layer.composed(want_x, want_res, ctx.positions, pair, ctx)
    for (k, v), (wk, wv) in zip(fused_kv, want_kv):
        np.testing.assert_array_equal(k.numpy(), wk.numpy())
        np.testing.assert_array_equal(v.numpy(), wv.numpy())
    np.testing.assert_array_equal(got[0].numpy(), want_x.numpy())
    np.testing.assert_array_equal(got[1].numpy(), want_res.numpy())


def test_the_port_composes_a_step_whose_products_would_be_dequantized(monkeypatch):
    """Where the composed product of a layer's kind is dequantize + BLAS from some row count
    (cpp.quant_blas_min_rows: AVX2's q8_0 from 1024), the stack and the one-layer call leave a
    step of that many rows to the composed layers (which keep that product), and take one
    row fewer."""
    import paddle
    from fdx.ops import layer_port
    layers, cfg, x, ctx, kv = long_step("q8_0", 12)
    rows = sum(LONG_QUERY_LENS)
    monkeypatch.setattr(cpp, "quant_blas_min_rows", lambda kind, variant: rows if kind == "q8_0" else None)
    monkeypatch.setattr(layer_port._PORT, "_stack", None)
    fused = [layer.fused for layer in layers]
    with kernels.using(cpu_kernel_table()):
        assert layer_port.decoder_stack(paddle.to_tensor(x), fused, kv(), ctx) is None
        assert layer_port.decoder_layer(paddle.to_tensor(x), None, fused[0], kv()[0], ctx) is None
        monkeypatch.setattr(cpp, "quant_blas_min_rows", lambda kind, variant: rows + 1 if kind == "q8_0" else None)
        monkeypatch.setattr(layer_port._PORT, "_stack", None)
        assert layer_port.decoder_stack(paddle.to_tensor(x), fused, kv(), ctx) is not None
        assert layer_port.decoder_layer(paddle.to_tensor(x), None, fused[0], kv()[0], ctx) is not None


def test_a_long_step_under_batch_invariance_gives_each_sequence_its_solo_bits():
    """backend.batch_invariant: the 156-row step in the compiled stack (the port takes it at
    any row count there: no kind is dequantized) gives each sequence's rows and cache slots
    the bits of that sequence run alone in its own step."""
    import dataclasses

    import paddle
    from fdx.core.interfaces import AttentionContext
    from fdx.ops import attention, layer_port
    from fdx.plugins.backends.attention import CpuAttention
    layers, cfg, x, ctx, kv = long_step("mixed", 13)
    fused = [layer.fused for layer in layers]
    slots = kv()[0][0].shape[0] // cfg.num_kv_heads
    with kernels.using(dataclasses.replace(cpu_kernel_table(), batch_invariant=True)):
        batched_kv = kv()
        got = layer_port.decoder_stack(paddle.to_tensor(x), fused, batched_kv, ctx)
        assert got is not None
        start = 0
        for ql, cl, table in zip(LONG_QUERY_LENS, LONG_CONTEXT_LENS, LONG_TABLES):
            solo_kv = kv()
            meta = attention.build_attention_metadata([ql], [cl], [table], LONG_BLOCK, cfg.num_kv_heads, slots,
                                                      impl="cpp")
            solo = layer_port.decoder_stack(paddle.to_tensor(x[start:start + ql]), fused, solo_kv,
                                            AttentionContext(CpuAttention(), meta))
            for g, s in zip(got, solo):
                np.testing.assert_array_equal(g.numpy()[start:start + ql], s.numpy())
            rows = np.array([(h * slots + table[p // LONG_BLOCK] * LONG_BLOCK + p % LONG_BLOCK)
                             for h in range(cfg.num_kv_heads) for p in range(cl, cl + ql)])
            for (bk, bv), (sk, sv) in zip(batched_kv, solo_kv):
                np.testing.assert_array_equal(bk.numpy()[rows], sk.numpy()[rows])
                np.testing.assert_array_equal(bv.numpy()[rows], sv.numpy()[rows])
            start += ql
