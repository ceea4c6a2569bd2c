"""model.task=embed: the pooling runner's embeddings equal transformers'
final hidden states (after the final norm) of the same tiny random
checkpoint, pooled the same way in numpy: last token or mean, L2-normalized
or not, whole prompts or chunked prefill, several prompts in one batch.
Tolerance: 1e-4 absolute (float32 through two stacks of different kernels)."""
from __future__ import annotations

import numpy as np
import pytest

from fdx import LLM, SamplingParams

PROMPTS = [[5, 9, 200, 31, 7], list(range(60, 90)), [1000, 1, 2, 3]]


def hf_pooled(hf, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    import torch
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    v = h[-1] if pooling == "last" else h.mean(axis=0)
    return v / np.linalg.norm(v) if normalize else v


@pytest.mark.parametrize("arch,pooling,normalize,chunk", [
    ("Qwen3ForCausalLM", "last", True, None),         # Qwen3-Embedding's pooling
    ("Qwen3ForCausalLM", "mean", False, 8),           # mean over chunks of 8 prompt tokens
    ("LlamaForCausalLM", "mean", True, None),
    ("LlamaForCausalLM", "last", False, 8),
])
def test_embeddings_equal_transformers_pooled_hidden_states(tiny_checkpoints, arch, pooling, normalize, chunk):
    path, hf = tiny_checkpoints[arch]
    kw = dict(max_num_batched_tokens=chunk) if chunk else {}
    llm = LLM(str(path), task="embed", pooling_type=pooling, normalize=normalize, max_model_len=64,
              num_kv_blocks=40, block_size=4, progress=False, **kw)
    outs = llm.embed([{"prompt_token_ids": ids} for ids in PROMPTS])
    assert [o.prompt_token_ids for o in outs] == PROMPTS and outs[0].outputs.embedding == outs[0].embedding
    for o, ids in zip(outs, PROMPTS):
        np.testing.assert_allclose(o.embedding, hf_pooled(hf, ids, pooling, normalize), atol=1e-4, rtol=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == 40           # every pooling request freed its blocks
    with pytest.raises(ValueError, match="embed"):
        llm.generate(["hi"], SamplingParams(max_tokens=2))


def test_embed_with_a_prefix_cache_takes_no_hit_and_stays_right(tiny_checkpoints):
    path, hf = tiny_checkpoints["Qwen3ForCausalLM"]
    llm = LLM(str(path), task="embed", pooling_type="mean", kv_cache="prefix", max_model_len=64,
              num_kv_blocks=40, block_size=4, progress=False)
    ids = list(range(60, 90))
    first, again = llm.embed([{"prompt_token_ids": ids}, {"prompt_token_ids": ids}])
    ref = hf_pooled(hf, ids, "mean", True)
    np.testing.assert_allclose(first.embedding, ref, atol=1e-4)
    np.testing.assert_allclose(again.embedding, ref, atol=1e-4)
    assert llm.embed([{"prompt_token_ids": ids}])[0].embedding == pytest.approx(first.embedding, abs=1e-5)


def test_a_generate_llm_refuses_embed(tiny_checkpoints):
    path, _ = tiny_checkpoints["Qwen3ForCausalLM"]
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    with pytest.raises(ValueError, match="task=embed"):
        llm.embed(["hello"])
