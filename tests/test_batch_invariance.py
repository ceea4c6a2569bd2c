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
test_block_attention.py and test_quant_repack.py.
"""
from __future__ import annotations

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


def _run(batches: list[list[str]], recomputed: list | None = None, **kw) -> list[list[tuple]]:
    """(token ids, top logprobs) of each prompt, a batch a ``generate`` call,
    all on one engine; ``recomputed`` gets the engine's count of recomputed
    (preempted) tokens."""
    args = dict(resource_manager="v1", kv_cache="paged", block_size=16, num_kv_blocks=96,
                max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024, progress=False,
                batch_invariant=True)
    args.update(kw)
    llm = LLM(**args)
    try:
        got = []
        for prompts in batches:
            out = llm.generate(prompts, _params())
            got.append([(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in out])
        if recomputed is not None:
            recomputed.append(llm.engine.num_recomputed_tokens)
        return got
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def in_order():
    """quant -> the six prompts generated together in order (one engine each, built on first use)."""
    done: dict[str, list[tuple]] = {}

    def get(quant: str) -> list[tuple]:
        if quant not in done:
            (done[quant],) = _run([PROMPTS], quantization=QUANT[quant])
        return done[quant]
    return get


def _same(got: list[tuple], want: list[tuple], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"{what}: prompt {i} tokens differ: {g[0]} != {w[0]}"
        assert g[1] == w[1], f"{what}: prompt {i} logprobs differ"


@pytest.mark.slow
@pytest.mark.parametrize("quant", list(QUANT))
def test_reversed_and_solo_equal_in_order(in_order, quant):
    """On a second engine: the prompts reversed, then each alone (a generate call of one prompt)."""
    rev, *solo = _run([PROMPTS[::-1], *([p] for p in PROMPTS)], quantization=QUANT[quant])
    _same(rev[::-1], in_order(quant), "reversed")
    _same([s[0] for s in solo], in_order(quant), "one at a time")


# Every other variant once, the two quantizations taking turns (pairwise: a
# variant changes the steps' shapes, the quantization the products in them;
# each product kind meets chunking, a scheduler/cache change and a thread
# change): (id, quant, engine settings)
VARIANTS = [
    ("chunk-32", "float32", dict(max_num_batched_tokens=32)),
    ("chunk-256", "q4_1", dict(max_num_batched_tokens=256)),
    ("v0-paged", "float32", dict(resource_manager="v0", kv_cache="paged")),
    ("v0-prefix", "q4_1", dict(resource_manager="v0", kv_cache="prefix")),
    ("v1-prefix", "float32", dict(resource_manager="v1", kv_cache="prefix")),
    # the shared system prompt's blocks are cached by the first request and hit by the later ones
    ("prefix-hit", "q4_1", dict(kv_cache="prefix", max_num_seqs=1)),
    ("one-thread", "q4_1", dict(num_threads=1)),     # the thread split does not move a row's bits
]


@pytest.mark.slow
@pytest.mark.parametrize("quant, settings", [pytest.param(q, s, id=f"{name}-{q}") for name, q, s in VARIANTS])
def test_variant_equals_in_order(in_order, quant, settings):
    (got,) = _run([PROMPTS], quantization=QUANT[quant], **settings)
    _same(got, in_order(quant), str(settings))


@pytest.mark.slow
def test_preempted_and_resumed(in_order):
    # 6 prompts of about 40 tokens + 16 generated, four running at once: 8 blocks of 16
    # cannot hold four (4 blocks each), so requests are preempted and recomputed
    recomputed: list[int] = []
    (got,) = _run([PROMPTS], recomputed, num_kv_blocks=8, max_model_len=128, quantization="none")
    _same(got, in_order("float32"), "preempted")
    assert recomputed[0] > 0, "no request was preempted"


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
