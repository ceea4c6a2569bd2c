"""End to end through LLM, against Hugging Face transformers on the same checkpoints."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import TINY_ARCHS, smollm_gguf_path
from fdx import LLM, SamplingParams
from fdx.core.hookspecs import hookimpl

GREEDY32 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


# Two float32 implementations of one model differ in rounding: on the tiny
# checkpoints fdx's and transformers' logits (magnitude ~7) differ by up to
# 1e-5, and each differs from float64 by ~5e-6. When the top two logits are
# closer than that, rounding picks the greedy token; 1e-4 leaves a margin of
# 10 over the largest difference measured, and typical gaps are ~0.2.
NEAR_TIE = 1e-4


def hf_greedy(model, prompt_ids: list[int], n: int, follow: list[int] | None = None,
              near_tie: float = NEAR_TIE, rel_tie: float = 0.0) -> list[int]:
    """Plain greedy decoding with transformers, eos not special (as ignore_eos).

    ``follow`` is the other side's greedy tokens: where transformers' top two
    are a near-tie (within ``near_tie``, NEAR_TIE unless told, or within
    ``rel_tie`` of the step's logit range, for kernels with a known relative
    error) and ``follow`` took the other of them,
    transformers goes on with that token too, so that a rounding does not end
    the comparison; a token outside the tie is never followed."""
    ids = list(prompt_ids)
    past = None
    nxt = torch.tensor([ids])
    with torch.no_grad():
        for i in range(n):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1]
            tok = int(logits.argmax())
            if follow is not None and i < len(follow) and follow[i] != tok and \
                    float(logits[tok] - logits[follow[i]]) < max(near_tie, rel_tie * float(logits.max() - logits.min())):
                tok = follow[i]
            ids.append(tok)
            nxt = torch.tensor([[tok]])
    return ids[len(prompt_ids):]


@pytest.fixture(scope="module")
def hf_smollm(hf_smollm_model):
    return hf_smollm_model


def test_smollm_greedy_matches_transformers(smollm_llm, hf_smollm):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    outs = smollm_llm.generate(prompts, GREEDY32)
    for prompt, out in zip(prompts, outs):
        ids = smollm_llm.tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf_smollm, ids, 32, follow=got), prompt
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_architectures_match_transformers(arch, tiny_checkpoints):
    path, hf_model = tiny_checkpoints[arch]
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, block_size=8, progress=False)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 49152, n).tolist() for n in (5, 17)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY32)
    for p, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(hf_model, p, 32, follow=got)


@pytest.mark.slow
def test_batch_with_chunking_and_preemption_equals_solo_runs(tmp_path):
    """A tiny random Llama (the scheduler's behaviour does not need the
    embedded model; its greedy tokens are checked against transformers above):
    16 requests at once, chunked and preempted, give each request's solo tokens."""
    from tiny_models import TinyLlama
    path = str(TinyLlama(vocab=512, hidden=64, intermediate=128, heads=4, kv_heads=2, max_len=256)
               .hf_dir(tmp_path / "m"))
    rng = np.random.default_rng(1)
    lens = [3, 40, 7, 90, 15, 1, 64, 33, 5, 120, 9, 50, 2, 77, 21, 11]
    prompts = [{"prompt_token_ids": rng.integers(2, 512, n).tolist()} for n in lens]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = LLM(path, max_model_len=256, num_kv_blocks=64, block_size=8, progress=False)
    solo = [alone.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    # 16 at once, a 64-token step budget (chunked prefill), and 32 blocks of
    # 8 tokens: far less than 16 sequences need, so the scheduler preempts
    small = LLM(path, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=64, num_kv_blocks=32,
                block_size=8, progress=False)
    rec = StepRecorder()
    small.engine.plugins.pm.register(rec)
    try:
        outs = small.generate(prompts, sp)
    finally:
        small.engine.plugins.pm.unregister(rec)
    assert [o.outputs[0].token_ids for o in outs] == solo
    eng = small.engine
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks      # nothing leaked
    assert sum(s.num_preempted for s in rec.stats) > 0                 # preemption happened
    assert max(s.num_scheduled_tokens for s in rec.stats) <= 64         # budget held
    assert any(0 < s.num_prefill_tokens and s.num_decode_tokens for s in rec.stats)  # mixed steps


class StepRecorder:
    def __init__(self):
        self.stats = []

    @hookimpl
    def fdx_step_finished(self, scheduler_output, step_stats):
        self.stats.append(step_stats)
