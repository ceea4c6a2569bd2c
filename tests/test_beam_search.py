"""LLM.beam_search against transformers' generate(num_beams=...) on the same
float32 weights: the same best sequence and, when no beam ends early, the
same beams in the same order with the same scores."""
from __future__ import annotations

import pytest

from fdx import LLM, BeamSearchParams

@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path, model = tiny_checkpoints["LlamaForCausalLM"]
    with LLM(str(path), max_model_len=128, num_kv_blocks=64, block_size=16, progress=False) as llm:
        yield llm, model


@pytest.mark.slow
@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_search_equals_transformers(tiny, beam_width):
    import torch
    llm, model = tiny
    prompts = [[1, 415, 2936, 9060, 285], [1, 7000, 12, 33]]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=beam_width, max_tokens=6))
    for p, out in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), num_beams=beam_width, num_return_sequences=beam_width,
                                do_sample=False, max_new_tokens=6, length_penalty=1.0, early_stopping=True,
                                output_scores=True, return_dict_in_generate=True, pad_token_id=2)
        seqs = hf.sequences.tolist()
        assert all(2 not in s[len(p):] for s in seqs), "an eos beam: the comparison below assumes none"
        assert [s.tokens for s in out.sequences] == seqs
        # transformers' score: the generated tokens' summed logprob over their count; fdx's cum_logprob
        for s, score in zip(out.sequences, hf.sequences_scores.tolist()):
            assert s.cum_logprob / 6 == pytest.approx(score, abs=1e-4)
            assert s.finish_reason == "length" and s.text == llm.tokenizer.decode(s.tokens, skip_special_tokens=True)


def test_bad_beam_parameters_name_the_field():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
