"""A request's logits do not depend on what else shares its steps (issue 40 item 4).

The engine-level tests run the embedded default model (SmolLM2-135M) with
``backend.batch_invariant`` on six prompts with a shared system prompt and
compare, bitwise, every generated token and its top logprobs across batch
orders, chunk budgets, preemption, prefix-cache hits and the v0/v1 x
paged/prefix combinations (orders on both, the other variants pairwise):
in float32 (``quantization="none"``: inv's
kernels, attention, float32 products, norms, the compiled layer) and in the
checkpoint's Q4_1 (the quantized products too: under
``backend.batch_invariant`` the int8 kernels at every row count, no
dequantize + BLAS). The kernel-level tests are in test_f32_kernels.py,
test_block_attention.py and test_quant_repack.py; the batch-invariant attention
kernel's are at the end of this file (a row's bits against the rows and keys a
call takes, and the AVX-512 primitives against the AVX2 ones, through
tests/data/invariant_isa_check.cc).
"""
from __future__ import annotations

import contextlib
import gc

import pytest

from fdx import LLM, SamplingParams

SYSTEM = ("You are a careful assistant. Answer in one short sentence, plainly, and do not repeat the "
          "question. Numbers are written as digits. ")
QUESTIONS = ["What is the capital of France?", "Name a prime number above ten.",
             "Why is the sky blue?", "What does a compiler do?", "Give a synonym of quick.",
             "How many legs does a spider have?"]
PROMPTS = [SYSTEM + q for q in QUESTIONS]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)


# float32 (quantization "none") and the checkpoint's Q4_1 ("auto")
QUANT = {"float32": "none", "q4_1": "auto"}


BASE = dict(resource_manager="v1", kv_cache="paged", block_size=16, num_kv_blocks=96,
            max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024, progress=False,
            batch_invariant=True)


def _generate(llm: LLM, batches: list[list[str]]) -> list[list[tuple]]:
    """(token ids, top logprobs) of each prompt, a batch a ``generate`` call."""
    got = []
    for prompts in batches:
        out = llm.generate(prompts, _params())
        got.append([(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in out])
    return got


def _run(batches: list[list[str]], **kw) -> list[list[tuple]]:
    """_generate on an engine of its own (BASE with ``kw``), closed after."""
    llm = LLM(**{**BASE, **kw})
    try:
        return _generate(llm, batches)
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def engines():
    """quant -> one engine with BASE's settings (built on first use), shared
    by the module's tests: a test that needs other scheduling settings
    (chunk budget, KV scheduler, KV cache, pool size, batch size) swaps
    them in with ``EngineCore.reconfigure``, which keeps the model and the
    KV tensors and builds the scheduling side anew, and swaps BASE's back
    after. Loading SmolLM2 once per quantization, not once per variant."""
    built: dict[str, LLM] = {}

    def get(quant: str) -> LLM:
        if quant not in built:
            built[quant] = LLM(**{**BASE, "quantization": QUANT[quant]})
        return built[quant]
    yield get
    for llm in built.values():
        llm.close()
    built.clear()
    gc.collect()


@contextlib.contextmanager
def reconfigured(llm: LLM, **changes):
    engine = llm.engine
    keys = ("resource_manager", "kv_cache", "max_num_batched_tokens", "max_num_seqs", "num_kv_blocks")
    engine.reconfigure(**changes)
    try:
        yield engine
    finally:
        engine.reconfigure(**{k: BASE[k] for k in keys})


@pytest.fixture(scope="module")
def in_order(engines):
    """quant -> the six prompts generated together in order, on BASE's settings."""
    done: dict[str, list[tuple]] = {}

    def get(quant: str) -> list[tuple]:
        if quant not in done:
            (done[quant],) = _generate(engines(quant), [PROMPTS])
        return done[quant]
    return get


def _same(got: list[tuple], want: list[tuple], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"{what}: prompt {i} tokens differ: {g[0]} != {w[0]}"
        assert g[1] == w[1], f"{what}: prompt {i} logprobs differ"


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(QUANT))
def test_reversed_and_solo_equal_in_order(engines, in_order, quant):
    """The prompts reversed, then each alone (a generate call of one prompt)."""
    want = in_order(quant)
    rev, *solo = _generate(engines(quant), [PROMPTS[::-1], *([p] for p in PROMPTS)])
    _same(rev[::-1], want, "reversed")
    _same([s[0] for s in solo], want, "one at a time")


# Every other variant once, the two quantizations taking turns (pairwise: a
# variant changes the steps' shapes, the quantization the products in them;
# each product kind meets chunking, a scheduler/cache change and a thread
# change): (id, quant, scheduling settings swapped in)
VARIANTS = [
    ("chunk-32", "float32", dict(max_num_batched_tokens=32)),
    ("chunk-256", "q4_1", dict(max_num_batched_tokens=256)),
    ("v0-paged", "float32", dict(resource_manager="v0", kv_cache="paged")),
    ("v0-prefix", "q4_1", dict(resource_manager="v0", kv_cache="prefix")),
    ("v1-prefix", "float32", dict(resource_manager="v1", kv_cache="prefix")),
    # the shared system prompt's blocks are cached by the first request and hit by the later ones
    ("prefix-hit", "q4_1", dict(kv_cache="prefix", max_num_seqs=1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("quant, settings", [pytest.param(q, s, id=f"{name}-{q}") for name, q, s in VARIANTS])
def test_variant_equals_in_order(engines, in_order, quant, settings):
    want = in_order(quant)
    with reconfigured(engines(quant), **settings) as engine:
        assert all(getattr(engine.config.scheduler, k, v) == v for k, v in settings.items()
                   if k.startswith("max_num")), engine.config.scheduler
        (got,) = _generate(engines(quant), [PROMPTS])
    _same(got, want, str(settings))


@pytest.mark.slow
def test_one_thread_equals_in_order(in_order):
    """The thread split does not move a row's bits (an engine of its own: the
    thread count is the backend's)."""
    (got,) = _run([PROMPTS], quantization=QUANT["q4_1"], num_threads=1)
    _same(got, in_order("q4_1"), "one thread")


@pytest.mark.slow
def test_preempted_and_resumed(engines, in_order):
    # 6 prompts of about 40 tokens + 16 generated, four running at once: 8 blocks of 16
    # cannot hold four (4 blocks each), so requests are preempted and recomputed
    want = in_order("float32")
    llm = engines("float32")
    before = llm.engine.num_recomputed_tokens
    with reconfigured(llm, num_kv_blocks=8):
        (got,) = _generate(llm, [PROMPTS])
    _same(got, want, "preempted")
    assert llm.engine.num_recomputed_tokens > before, "no request was preempted"


@pytest.mark.slow
def test_tp3_is_invariant_within_itself():
    """TP 3 on the default path (Q4_1; SmolLM2-135M has 9 heads) is batch-invariant within itself: the prompts
    reversed, and the first one alone, give bitwise the in-order run's tokens and
    logprobs at TP 3, on one TP 3 engine. (TP 3 against TP 1 may part: the all-reduce sums the ranks'
    partial products in another order than one rank does; test_tensor_parallel.py.)"""
    prompts = PROMPTS[:3]
    want, rev, solo = _run([prompts, prompts[::-1], prompts[:1]], quantization="auto", tensor_parallel_size=3)
    _same(rev[::-1], want, "TP 3 reversed")
    _same(solo, want[:1], "TP 3 solo")


# The batch-invariant attention kernel itself (csrc/invariant_attention.h): a row's bits
# depend on its query, position and keys only, whichever primitives the CPU runs (the
# AVX-512 build takes a part's K transposed from 6 rows a call and 4 keys at a time below,
# P.V 6 rows at once; AVX2 3 rows; portable for head_dim % 32 != 0).
def _paged_invariant(q, k, v, specs, tables, kvh, threads=2):
    """The invariant kernel on sequences ``specs`` [(query_len, context_len)], q rows in order."""
    import numpy as np
    from test_cpp_ops import _invariant_attention
    return _invariant_attention(np.ascontiguousarray(q), k, v, specs, tables, threads, kvh=kvh,
                                scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("h, kvh, d", [(9, 3, 64), (32, 8, 128), (8, 1, 64), (4, 4, 32), (6, 2, 48)])
def test_invariant_attention_row_bits_do_not_depend_on_rows_or_keys_per_call(h, kvh, d):
    """Every row of a 70-token prefill after 37 cached keys (tiles of 32, 32 and 6 tokens; parts
    cut at key 64 and 128) has the bits of the same row computed alone (a decode row: G rows a
    call, each part's keys up to that row's position, on 1 and 2 threads: the split decode on 2),
    in chunks of 2, 3, 5, 16 and 33 tokens (2G to 33G rows a call: both sides of the AVX-512
    build's 6-row threshold, P.V groups spanning tokens whose rows see different key counts),
    and beside other sequences in one step; and numpy's float64 attention within 2e-5. A
    primitive whose order depended on how many rows or keys one call computes fails here."""
    import numpy as np

    from fdx.ops import cpp
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    rng = np.random.default_rng(d + h)
    ctx, n, bs, blocks = 37, 70, 16, 40
    k = rng.standard_normal((kvh * blocks * bs, d)).astype(np.float32)
    v = rng.standard_normal((kvh * blocks * bs, d)).astype(np.float32)
    tables = rng.permutation(blocks).reshape(4, blocks // 4).astype(np.int32)  # 10 blocks a sequence
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    full = _paged_invariant(q, k, v, [(n, ctx)], tables[:1], kvh)
    slots = np.array([tables[0][p // bs] * bs + p % bs for p in range(ctx + n)])
    g = h // kvh
    for tok in range(n):  # float64, causal
        for head in range(h):
            kk = k.reshape(kvh, -1, d)[head // g][slots[:ctx + tok + 1]].astype(np.float64)
            vv = v.reshape(kvh, -1, d)[head // g][slots[:ctx + tok + 1]].astype(np.float64)
            sc = kk @ q[tok, head].astype(np.float64) * d ** -0.5
            p = np.exp(sc - sc.max())
            np.testing.assert_allclose(full[tok, head], (p / p.sum()) @ vv, rtol=2e-5, atol=2e-5)
    for threads in (1, 2):
        alone = np.concatenate([_paged_invariant(q[t:t + 1], k, v, [(1, ctx + t)], tables[:1], kvh, threads)
                                for t in range(n)])
        for t in range(n):
            assert np.array_equal(alone[t], full[t]), f"decode row {t} on {threads} threads"
    for c in (2, 3, 5, 16, 33):
        chunks = np.concatenate([_paged_invariant(q[i:i + c], k, v, [(min(c, n - i), ctx + i)], tables[:1], kvh, 1)
                                 for i in range(0, n, c)])
        bad = [t for t in range(n) if not np.array_equal(chunks[t], full[t])]
        assert not bad, f"rows {bad} in chunks of {c} tokens"
    other = rng.standard_normal((1 + 9 + 1, h, d)).astype(np.float32)
    for t0, tq in ((0, 9), (30, 9), (61, 9)):
        batch = np.concatenate([other[:1], q[t0:t0 + tq], other[1:]])
        got = _paged_invariant(batch, k, v, [(1, 100), (tq, ctx + t0), (9, 20), (1, 3)], tables[[1, 0, 2, 3]], kvh)
        assert np.array_equal(got[1:1 + tq], full[t0:t0 + tq]), f"tokens {t0}..{t0 + tq} beside other sequences"


@pytest.fixture(scope="module")
def primitives_lib(tmp_path_factory):
    """tests/data/invariant_isa_check.cc with ops/csrc's x86 units, under fdx.ops.cpp's flags."""
    import ctypes
    import pathlib
    import shutil
    import subprocess

    from fdx.core.host import cpu_flags
    from fdx.ops import cpp
    if shutil.which("g++") is None:
        pytest.skip("no g++ on PATH")
    if "avx512f" not in cpu_flags() or "FDX_NO_X86" in " ".join(cpp._cflags()):
        pytest.skip("no AVX-512 F here (or a portable build): one build of the primitives to compare")
    csrc = pathlib.Path(cpp.__file__).resolve().parent / "csrc"
    driver = pathlib.Path(__file__).resolve().parent / "data" / "invariant_isa_check.cc"
    out = tmp_path_factory.mktemp("isa") / "invariant_isa_check.so"
    subprocess.run(["g++", *cpp._cflags(), "-shared", "-fPIC", f"-I{csrc}", str(driver), str(csrc / "isa_avx2.cc"),
                    str(csrc / "isa_avx512.cc"), "-o", str(out)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(out))


@pytest.mark.slow
@pytest.mark.parametrize("h, kvh, d", [(9, 3, 64), (32, 8, 128), (8, 1, 64), (4, 4, 32)])
def test_invariant_attention_avx512_primitives_give_the_avx2_bits(primitives_lib, h, kvh, d):
    """The AVX-512 primitives (isa_avx512.cc: transposed K from 6 rows, two keys a register
    below, 16-float exp and P.V) compute the AVX2 primitives' order, so a row has the same bits
    on a CPU with AVX-512 as on one with AVX2 only: one step of decode rows, a verify-sized
    chunk, prefills from 0 and 37 cached keys, on 1 and 2 threads; the portable primitives
    within float32 rounding of both."""
    import ctypes

    import numpy as np
    rng = np.random.default_rng(3 * d + h)
    specs = [(1, 300), (9, 1000), (70, 37), (1, 5), (33, 0), (1, 64)]  # (query_len, context_len)
    bs, width = 16, 64
    blocks = width * len(specs)
    k = rng.standard_normal((kvh * blocks * bs, d)).astype(np.float32)
    v = rng.standard_normal((kvh * blocks * bs, d)).astype(np.float32)
    tables = rng.permutation(blocks).reshape(len(specs), width).astype(np.int32)
    n = sum(ql for ql, _ in specs)
    q = rng.standard_normal((n, h, d)).astype(np.float32)
    info, at = [], 0
    for ql, cl in specs:
        info.append([at, ql, cl, at])
        at += ql
    info = np.array(info, np.int32)

    def run(primitives, threads):
        out = np.full((n, h, d), np.nan, np.float32)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        primitives_lib.check_invariant_attention(
            ptr(q), ptr(k), ptr(v), ptr(out), ptr(info), ptr(tables), ctypes.c_int64(width), ctypes.c_int64(h),
            ctypes.c_int64(kvh), ctypes.c_int64(d), ctypes.c_int64(bs), ctypes.c_int64(blocks * bs),
            ctypes.c_float(d ** -0.5), ctypes.c_int64(len(specs)), ctypes.c_int(threads), ctypes.c_int(primitives))
        return out

    avx2 = run(1, 1)
    assert np.isfinite(avx2).all()
    for threads in (1, 2):
        got = run(2, threads)
        bad = np.argwhere((got != avx2).any(axis=(1, 2))).ravel()
        assert bad.size == 0, f"AVX-512 rows {bad.tolist()} differ from AVX2's on {threads} threads"
    np.testing.assert_allclose(run(0, 1), avx2, rtol=1e-5, atol=1e-6)
