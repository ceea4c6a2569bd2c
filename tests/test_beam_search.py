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


# -- over HTTP: use_beam_search, best_of and suffix on /v1/completions ----------------------------

FIM = {"<repo_name>": "<fim_prefix>", "<reponame>": "<fim_suffix>", "<file_sep>": "<fim_middle>"}   # ids 3, 4, 5


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory, tiny_checkpoints):
    """The tiny Llama served with a tokenizer whose special tokens 3, 4, 5 are
    renamed to StarCoder's FIM tokens (the same weights as ``tiny``)."""
    import shutil

    from serve_utils import serving
    src, _ = tiny_checkpoints["LlamaForCausalLM"]
    d = tmp_path_factory.mktemp("tiny_fim")
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (d / name).read_text()
        for old, new in FIM.items():
            text = text.replace(f'"{old}"', f'"{new}"')
        (d / name).write_text(text)
    with serving(tmp_path_factory.mktemp("serve_fim"), model={"model": str(d), "max_model_len": 128,
                                                              "quantization": "none"},
                 server={"served_model_name": "tiny"}) as srv:
        yield srv


def post(srv, body: dict):
    import httpx

    from serve_utils import API_KEY
    return httpx.post(srv.base_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tiny", **body}, timeout=300)


@pytest.mark.slow
def test_use_beam_search_over_http_equals_llm_and_transformers(fim_server, tiny):
    import torch
    llm, model = tiny
    prompts = [[1, 415, 2936, 9060, 285], [1, 7000, 12, 33]]
    r = post(fim_server, {"prompt": prompts, "n": 3, "max_tokens": 5, "use_beam_search": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    want = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=5))
    for i, (p, out) in enumerate(zip(prompts, want)):
        got = [c for c in choices if c["index"] // 3 == i]
        assert [c["index"] for c in got] == [3 * i, 3 * i + 1, 3 * i + 2]
        assert [c["text"] for c in got] == [llm.tokenizer.decode(s.tokens[len(p):], skip_special_tokens=True)
                                           for s in out.sequences]
        assert [c["cumulative_logprob"] for c in got] == pytest.approx([s.cum_logprob for s in out.sequences],
                                                                       abs=1e-5)
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), num_beams=3, do_sample=False, max_new_tokens=5,
                                early_stopping=True, pad_token_id=2)
        assert out.sequences[0].tokens == hf[0].tolist()
        assert got[0]["text"] == llm.tokenizer.decode(hf[0, len(p):].tolist(), skip_special_tokens=True)
    for body, param in (({"use_beam_search": True, "n": 11}, "n"), ({"use_beam_search": True, "stream": True}, "stream"),
                        ({"use_beam_search": True, "logprobs": 1}, "logprobs"), ({"length_penalty": 0.5}, "length_penalty"),
                        ({"n": 2, "best_of": 1}, "best_of"), ({"best_of": 2, "stream": True}, "best_of")):
        r = post(fim_server, {"prompt": [1, 2, 3], "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


@pytest.mark.slow
def test_best_of_returns_the_best_by_cumulative_logprob(fim_server, tiny):
    from fdx import SamplingParams
    llm, _ = tiny
    prompt = [1, 415, 2936, 9060, 285]
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 1.0, "seed": 7}
    (cands,) = llm.generate([{"prompt_token_ids": prompt}],
                            SamplingParams(n=5, max_tokens=4, temperature=1.0, seed=7, logprobs=0))
    ranked = sorted(cands.outputs, key=lambda o: -sum(lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs)))
    r = post(fim_server, {**body, "n": 2, "best_of": 5}).json()
    assert [c["text"] for c in r["choices"]] == [o.text for o in ranked[:2]]
    assert [c["index"] for c in r["choices"]] == [0, 1] and r["choices"][0]["logprobs"] is None
    r = post(fim_server, {**body, "n": 1, "best_of": 5, "logprobs": 0}).json()
    assert r["choices"][0]["text"] == ranked[0].text
    assert sum(r["choices"][0]["logprobs"]["token_logprobs"]) == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(ranked[0].token_ids, ranked[0].logprobs)), abs=1e-5)


@pytest.mark.slow
def test_suffix_is_fill_in_the_middle(fim_server, tiny):
    from fdx import SamplingParams
    llm, _ = tiny
    prefix, suffix = "def add(a, b):\n    return", "\n\nprint(add(1, 2))\n"
    enc = lambda t: llm.tokenizer.encode(t, add_special_tokens=False)
    ids = [3, *enc(prefix), 4, *enc(suffix), 5]           # <fim_prefix> prefix <fim_suffix> suffix <fim_middle>
    (want,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, temperature=0.0))
    r = post(fim_server, {"prompt": prefix, "suffix": suffix, "max_tokens": 6, "temperature": 0}).json()
    assert r["choices"][0]["text"] == want.outputs[0].text and r["usage"]["prompt_tokens"] == len(ids)
    r = post(fim_server, {"prompt": prefix, "suffix": suffix, "echo": True, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
