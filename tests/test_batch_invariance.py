"""A request's logits do not depend on what else shares its steps (issue 40 item 4).

The engine-level tests run the embedded default model (SmolLM2-135M) with
``backend.batch_invariant`` on six prompts with a shared system prompt and
compare, bitwise, every generated token and its top logprobs across batch
orders, chunk budgets, preemption, prefix-cache hits and the v0/v1 x
paged/prefix combinations: in float32 (``quantization="none"``: inv's
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


QUANT = [pytest.param("none", id="float32"), pytest.param("auto", id="q4_1")]


@pytest.fixture(scope="module", params=QUANT)
def quantization(request):
    return request.param


def _run(prompts: list[str], recomputed: list | None = None, **kw) -> list[tuple]:
    """(token ids, top logprobs) of each prompt, generated together by one engine;
    ``recomputed`` gets the engine's count of recomputed (preempted) tokens."""
    args = dict(resource_manager="v1", kv_cache="paged", block_size=16, num_kv_blocks=96,
                max_num_batched_tokens=64, max_num_seqs=4, max_model_len=1024, progress=False,
                batch_invariant=True)
    args.update(kw)
    llm = LLM(**args)
    try:
        out = llm.generate(prompts, _params())
        if recomputed is not None:
            recomputed.append(llm.engine.num_recomputed_tokens)
        return [(tuple(o.outputs[0].token_ids), repr(o.outputs[0].logprobs)) for o in out]
    finally:
        llm.close()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def in_order(quantization):
    return _run(PROMPTS, quantization=quantization)


def _same(got: list[tuple], want: list[tuple], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[0] == w[0], f"{what}: prompt {i} tokens differ: {g[0]} != {w[0]}"
        assert g[1] == w[1], f"{what}: prompt {i} logprobs differ"


@pytest.mark.slow
def test_reversed_and_solo_equal_in_order(in_order, quantization):
    _same(_run(PROMPTS[::-1], quantization=quantization)[::-1], in_order, "reversed")
    _same([_run([p], quantization=quantization)[0] for p in PROMPTS], in_order, "one at a time")


@pytest.mark.slow
@pytest.mark.parametrize("budget", [32, 256])
def test_chunk_budget(in_order, quantization, budget):
    _same(_run(PROMPTS, max_num_batched_tokens=budget, quantization=quantization), in_order, f"max_num_batched_tokens={budget}")


@pytest.mark.slow
def test_preempted_and_resumed(in_order, quantization):
    # 6 prompts of about 40 tokens + 16 generated, four running at once: 8 blocks of 16
    # cannot hold four (4 blocks each), so requests are preempted and recomputed
    recomputed: list[int] = []
    _same(_run(PROMPTS, recomputed, num_kv_blocks=8, max_model_len=128, quantization=quantization), in_order, "preempted")
    assert recomputed[0] > 0, "no request was preempted"


@pytest.mark.slow
@pytest.mark.parametrize("rm,cache", [("v0", "paged"), ("v0", "prefix"), ("v1", "prefix")])
def test_schedulers_and_caches(in_order, quantization, rm, cache):
    _same(_run(PROMPTS, resource_manager=rm, kv_cache=cache, quantization=quantization), in_order, f"{rm}/{cache}")


@pytest.mark.slow
def test_prefix_hit(in_order, quantization):
    """The shared system prompt's blocks are cached by the first request and hit by the later ones."""
    _same(_run(PROMPTS, kv_cache="prefix", max_num_seqs=1, quantization=quantization), in_order, "prefix hit, one at a time")


@pytest.mark.slow
def test_one_thread_equals_two(in_order, quantization):
    """The thread split does not move a row's bits: one thread gives the two-thread run's tokens and logprobs."""
    _same(_run(PROMPTS, quantization=quantization, num_threads=1), in_order, "one thread")


@pytest.mark.slow
def test_tp3_is_invariant_within_itself():
    """TP 3 on the default path (Q4_1; SmolLM2-135M has 9 heads) is batch-invariant within itself: the prompts
    reversed, and the first one alone, give bitwise the in-order run's tokens and
    logprobs at TP 3. (TP 3 against TP 1 may part: the all-reduce sums the ranks'
    partial products in another order than one rank does; test_tensor_parallel.py.)"""
    prompts = PROMPTS[:3]
    want = _run(prompts, quantization="auto", tensor_parallel_size=3)
    _same(_run(prompts[::-1], quantization="auto", tensor_parallel_size=3)[::-1], want, "TP 3 reversed")
    _same(_run(prompts[:1], quantization="auto", tensor_parallel_size=3), want[:1], "TP 3 solo")
