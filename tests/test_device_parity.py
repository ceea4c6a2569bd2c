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


def hf_greedy(model, ids, n):
    from test_llm import hf_greedy as run
    return run(model, ids, n)


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_on_the_device_equals_transformers(arch, tiny_checkpoints):
    path, hf = tiny_checkpoints[arch]
    llm = LLM(str(path), backend=BACKEND, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=8,
              progress=False)
    prompts = [np.random.default_rng(i).integers(3, 49152, n).tolist() for i, n in enumerate((5, 23))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in prompts]


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
