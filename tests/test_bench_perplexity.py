"""`fdx bench perplexity` against a brute-force recompute with transformers
on the same weights (llama-perplexity's chunking: second halves scored)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fdx import LLM
from fdx.entrypoints.bench.perplexity import chunk_prompts, default_text_path, perplexity
from test_weight_formats import TINY, VOCAB, files  # noqa: F401  (the module's GGUF fixture)


def brute_force_ppl(model, chunks: list[list[int]], ctx: int) -> float:
    nll, n = 0.0, 0
    with torch.no_grad():
        for c in chunks:
            logp = torch.log_softmax(model(torch.tensor([c])).logits[0].double(), -1).numpy()
            for j in range(ctx // 2 + 1, ctx):
                nll -= logp[j - 1, c[j]]
                n += 1
    return math.exp(nll / n)


@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_perplexity_of_a_quantized_file_equals_transformers_on_its_values(files, quantization):  # noqa: F811
    path, model = files["mixed"]
    ids = np.random.default_rng(0).integers(0, VOCAB, 100).tolist()
    llm = LLM(str(path), quantization=quantization, max_num_batched_tokens=24, **TINY)   # chunked prefill
    r = perplexity(llm, ids, ctx=32, bos=1)
    chunks = chunk_prompts(ids, 32, 1)
    assert r["chunks"] == 3 == len(chunks) and all(c[0] == 1 for c in chunks)
    assert r["tokens_scored"] == 3 * 15
    # fp32 products: to float rounding. Quantized products quantize the activations to int8 per
    # 32-element block (as llama.cpp does), which moves this tiny model's perplexity by ~0.05%.
    rel = 1e-4 if quantization == "none" else 3e-3
    assert r["perplexity"] == pytest.approx(brute_force_ppl(model, chunks, 32), rel=rel)


def test_a_text_shorter_than_one_chunk_is_refused():
    with pytest.raises(ValueError, match="fewer than one chunk"):
        chunk_prompts([1, 2, 3], 16, None)


@pytest.mark.slow
def test_cli_on_an_hf_checkpoint_with_the_default_text(tiny_checkpoints, capsys):
    from fdx.model_io.tokenizer import Tokenizer
    from fdx.entrypoints.cli import main
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    assert main(["bench", "perplexity", "--model", str(path), "--ctx", "64", "--chunks", "2", "--json",
                 "--num-kv-blocks", "64"]) == 0
    r = json.loads(capsys.readouterr().out)
    tok = Tokenizer.from_hf_dir(path)
    ids = tok.encode(open(default_text_path(), encoding="utf-8").read())
    chunks = chunk_prompts(ids, 64, tok.bos_token_id if tok.add_bos_token else None, 2)
    assert r["text_tokens"] == len(ids) > 20_000 and r["chunks"] == 2      # the default text: 20k tokens and more
    assert r["perplexity"] == pytest.approx(brute_force_ppl(hf, chunks, 64), rel=1e-4)
