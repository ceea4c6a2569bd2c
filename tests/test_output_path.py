"""One output path (core/output.py): the engine emits token ids and logprob
ids/values only, and matches stop strings where it makes the tokens (so it
computes none past one); the output processor makes the text, its cut at
the stop string, the logprob text and the n children, for LLM and the
server alike: the same SeqDeltas (one DeltaTracker) applied to the same
SequenceState in process and off the wire; LLM.chat's tool calls and
reasoning are the server's.

References: the Hugging Face tokenizer of the same checkpoint (text and
token strings), a brute-force stop-string search over the unstopped
output, n=1 requests with the seeds the rule gives, a real server
through the openai client, and jsonschema for tool arguments."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import time

import jsonschema
import msgspec
import openai
import pytest
import transformers

from fdx import LLM
from fdx.core.messages import EngineOutputs, EngineStats, FromEngine, encoder
from fdx.core.output import DeltaTracker, OutputProcessor, SequenceState, split_n
from fdx.core.request import request_output
from fdx.core.sampling_params import SamplingParams

from serve_utils import API_KEY, ready_server

MAX_LEN = 256
PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    llm = LLM(tiny_model, max_model_len=MAX_LEN, block_size=16, num_kv_blocks=64, progress=False)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    return transformers.AutoTokenizer.from_pretrained(tiny_model)


def first_stop_cut(hf_tok, ids: list[int], stop: str) -> tuple[list[int], str]:
    """Brute force: the shortest prefix of ``ids`` whose text holds ``stop``;
    its ids and the text before the stop string."""
    for k in range(1, len(ids) + 1):
        text = hf_tok.decode(ids[:k], skip_special_tokens=True)
        if stop in text:
            return ids[:k], text[:text.index(stop)]
    raise AssertionError(f"{stop!r} never appears")


def pick_stop(text: str, size: int) -> str:
    """``size`` plain ASCII characters from the middle of ``text``."""
    for i in range(len(text) // 3, len(text) - size):
        cut = text[i:i + size]
        if cut.isascii() and cut.isprintable() and cut.strip():
            return cut
    raise AssertionError(f"no plain stop string in {text!r}")


def test_split_n_seed_rule():
    kids = split_n(SamplingParams(n=3, seed=2**63 - 2))
    assert [k.seed for k in kids] == [2**63 - 2, 2**63 - 1, 0] and all(k.n == 1 for k in kids)
    assert [k.seed for k in split_n(SamplingParams(n=2))] == [None, None]
    one = SamplingParams(seed=5)
    assert split_n(one) == [one]


@pytest.mark.slow
def test_engine_makes_no_text(tiny_llm, hf_tok):
    """The token processor leaves the engine's requests without text or
    logprob text (it detokenizes only to match stop strings); the output
    processor makes both, equal to the HF tokenizer's."""
    eng = tiny_llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    req = eng.make_request(hf_tok.encode(PROMPT), sp)
    eng.add_request(req)
    outputs = OutputProcessor(eng)
    seq = outputs.add(req)
    # the server's side of the one path: the same deltas through msgpack (the engine process's
    # encoder, the API process's decoder) into a SequenceState, as RequestGroup applies them
    tracker, wire = DeltaTracker(), SequenceState("w", 0, 0, req.prompt_token_ids, sp, tiny_llm.tokenizer)
    tracker.track(req.request_id)
    decoder = msgspec.msgpack.Decoder(FromEngine)
    raw = []
    while not seq.finished:
        changed = eng.step()
        # what the engine produced, before the output processor sees it
        raw += [lp.decoded for r in changed if r is req for lp in r.logprobs[-1].values()]
        assert all(getattr(r, "output_text", "") == "" for r in changed)
        for r in changed:
            msg = decoder.decode(encoder.encode(EngineOutputs([tracker.delta(r)], EngineStats(0, 0, 0.0, 0, 0))))
            wire.apply(msg.outputs[0])
        outputs.process(changed)
    assert raw and all(d is None for d in raw)
    assert request_output(req).outputs[0].text == ""
    assert seq.text == hf_tok.decode(seq.token_ids, skip_special_tokens=True)
    assert len(seq.logprobs) == len(seq.token_ids) == 12
    for tid, rows, engine_entry in zip(seq.token_ids, seq.logprobs, req.logprobs):
        assert rows == [[t.token_id, t.logprob, t.rank] for t in engine_entry.values()]   # ids and values
        assert tid in engine_entry and [r[2] for r in rows] == sorted(r[2] for r in rows)
    assert (wire.text, wire.token_ids, wire.logprobs, wire.prompt_logprobs, wire.finish_reason) == \
        (seq.text, seq.token_ids, seq.logprobs, seq.prompt_logprobs, seq.finish_reason)
    out = tiny_llm.generate({"prompt_token_ids": req.prompt_token_ids}, sp)[0]
    assert out.outputs[0].token_ids == seq.token_ids and out.outputs[0].text == seq.text
    for tid, entry, engine_entry in zip(seq.token_ids, out.outputs[0].logprobs, req.logprobs):
        assert entry[tid].decoded == hf_tok.decode([tid])
        assert all(lp.decoded == hf_tok.decode([t]) for t, lp in entry.items())
        assert [(t, lp.logprob, lp.rank) for t, lp in entry.items()] == \
            [(t, lp.logprob, lp.rank) for t, lp in engine_entry.items()]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(req.prompt_token_ids)
    for t, d, engine_d in zip(req.prompt_token_ids[1:], out.prompt_logprobs[1:], req.prompt_logprobs[1:]):
        assert t in d and all(lp.decoded == hf_tok.decode([k]) for k, lp in d.items())
        assert [(k, lp.logprob, lp.rank) for k, lp in d.items()] == \
            [(k, lp.logprob, lp.rank) for k, lp in engine_d.items()]


@pytest.mark.slow
def test_stop_string_ends_the_engine_request_at_once(tiny_llm, hf_tok):
    eng = tiny_llm.engine
    free = eng.kv_cache.num_free_blocks
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = tiny_llm.generate(PROMPT, base)[0].outputs[0]
    assert ref.text == hf_tok.decode(ref.token_ids, skip_special_tokens=True)
    stop = pick_stop(ref.text, 3)
    want_ids, want_text = first_stop_cut(hf_tok, ref.token_ids, stop)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])

    req = eng.make_request(hf_tok.encode(PROMPT), sp)
    eng.add_request(req)
    outputs = OutputProcessor(eng)
    seq = outputs.add(req)
    steps, computed = 0, eng.num_computed_tokens
    while not seq.finished:
        changed = eng.step()
        steps += 1
        if changed and changed[0].is_finished:    # the engine ended it: no output processor told it to
            assert (req.status.value, req.stop_reason, req.output_token_ids) == ("stop", stop, want_ids)
        outputs.process(changed)
    # ended in the step that produced the stop token: nothing left, every block back, and no token
    # past the stop computed (the last sampled token is never computed)
    assert not eng.has_unfinished() and eng.kv_cache.num_free_blocks == free
    assert steps == len(want_ids) and req.status.value == "stop" and req.stop_reason == stop
    assert eng.num_computed_tokens - computed == req.num_prompt_tokens - req.num_cached_tokens + len(want_ids) - 1
    assert req.num_computed_tokens == req.num_tokens - 1
    assert (seq.text, seq.token_ids, seq.finish_reason, seq.stop_reason) == (want_text, want_ids, "stop", stop)

    out = tiny_llm.generate(PROMPT, sp)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (want_text, want_ids, "stop", stop)
    assert eng.kv_cache.num_free_blocks == free


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, tiny_model):
    srv = ready_server(tmp_path_factory.mktemp("serve_output_path"),
                       model={"model": tiny_model, "max_model_len": MAX_LEN})
    yield srv
    srv.stop()


@pytest.mark.slow
def test_llm_and_server_give_the_same_outputs(tiny_llm, tiny_server, hf_tok):
    """n=2 with a seed, logprobs and a stop string: the server's choices
    are LLM.generate's, token for token and character for character; each
    child i is the n=1 request with seed + i; the stop frees the server's
    blocks too."""
    seed, n_top = 11, 2
    free = tiny_server.metrics()["fdx:kv_cache_free_blocks"]
    plain = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed, n=2)
    ref = tiny_llm.generate(PROMPT, plain)[0].outputs
    text0 = ref[0].text
    stop = pick_stop(text0, 2)
    sp = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=seed, n=2, logprobs=n_top, stop=[stop])
    llm_out = tiny_llm.generate(PROMPT, sp)[0].outputs

    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=PROMPT, n=2, seed=seed, temperature=1.0, max_tokens=24,
                                     logprobs=n_top, stop=[stop], extra_body={"ignore_eos": True})
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert len(choices) == 2
    for i, (c, o) in enumerate(zip(choices, llm_out)):
        # the seed rule: child i is the n=1 request with seed + i
        alone = tiny_llm.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True,
                                                          seed=seed + i))[0].outputs[0]
        assert ref[i].token_ids == alone.token_ids
        if stop in ref[i].text:
            want_ids, want_text = first_stop_cut(hf_tok, ref[i].token_ids, stop)
            assert (o.finish_reason, o.stop_reason) == ("stop", stop)
        else:
            want_ids, want_text = ref[i].token_ids, ref[i].text
            assert o.finish_reason == "length"
        assert (o.text, o.token_ids) == (want_text, want_ids)
        assert c.text == o.text and c.finish_reason == o.finish_reason
        # logprob text: the same strings, the HF tokenizer's
        assert c.logprobs.tokens == [o.logprobs[k][t].decoded for k, t in enumerate(o.token_ids)]
        assert c.logprobs.tokens == [hf_tok.decode([t]) for t in o.token_ids]
        for k, t in enumerate(o.token_ids):
            assert c.logprobs.token_logprobs[k] == pytest.approx(o.logprobs[k][t].logprob, abs=1e-4)
            top = {lp.decoded: lp.logprob for lp in o.logprobs[k].values() if lp.rank <= n_top}
            assert set(c.logprobs.top_logprobs[k]) == set(top)
    assert llm_out[0].finish_reason == "stop"
    # the server aborted the stopped sequence: its blocks are back
    deadline = time.monotonic() + 10
    while tiny_server.metrics()["fdx:kv_cache_free_blocks"] != free and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tiny_server.metrics()["fdx:kv_cache_free_blocks"] == free


@pytest.mark.slow
def test_server_computes_no_token_past_a_stop_string(tiny_llm, tiny_server, hf_tok):
    """The server's engine process finishes a request with the token that
    completes a stop string: its count of computed tokens grows by the
    prompt and the kept tokens less one (the last sampled token is never
    computed), and not a token more once the request is gone. The prompt
    is shorter than a KV block, so no prefix hit changes the count."""
    prompt = "Once upon a time there was a fox"
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = tiny_llm.generate(prompt, base)[0].outputs[0]
    stop = pick_stop(ref.text, 3)
    want_ids, want_text = first_stop_cut(hf_tok, ref.token_ids, stop)
    assert len(want_ids) < 40
    before = tiny_server.metrics()["fdx:engine_computed_tokens"]
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    model = client.models.list().data[0].id
    resp = client.completions.create(model=model, prompt=prompt, temperature=0.0, max_tokens=40, stop=[stop],
                                     extra_body={"ignore_eos": True})
    c = resp.choices[0]
    assert (c.text, c.finish_reason, resp.usage.completion_tokens) == (want_text, "stop", len(want_ids))
    n_prompt = resp.usage.prompt_tokens
    assert n_prompt < 16                          # the default block_size
    deadline = time.monotonic() + 10              # the request has left the engine (nothing more can run)
    while tiny_server.metrics()["fdx:num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tiny_server.metrics()["fdx:engine_computed_tokens"] - before == n_prompt + len(want_ids) - 1


# -- LLM.chat with tools and a reasoning parser: the server's answer ---------------------

DATA = pathlib.Path(__file__).parent / "data"
PARSERS = {"tool_call_parser": "hermes", "enable_auto_tool_choice": True, "reasoning_parser": "qwen3"}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
             "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Paris for 2 days, and the time?"}]


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory, tiny_checkpoints):
    """A tiny random Qwen3 with Qwen3's chat template, as an LLM and as a
    server with the same parsers (hermes tool calls, qwen3 reasoning)."""
    src, _ = tiny_checkpoints["Qwen3ForCausalLM"]
    d = tmp_path_factory.mktemp("tiny_qwen3_chat")
    for f in pathlib.Path(src).iterdir():
        shutil.copy(f, d / f.name)
    shutil.copy(DATA / "qwen3_chat_template.jinja", d / "chat_template.jinja")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024                 # room for the tools' system prompt
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(d), max_model_len=1024, num_kv_blocks=96, progress=False,
              **{"decoding.guided_backend": "llguidance", **{f"server.{k}": v for k, v in PARSERS.items()}})
    srv = ready_server(tmp_path_factory.mktemp("serve_qwen3_chat"), model={"model": str(d), "max_model_len": 1024},
                       cache={"num_kv_blocks": 96}, decoding={"guided_backend": "llguidance"}, server=PARSERS)
    try:
        yield llm, openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
    finally:
        srv.stop()
        llm.close()


def same_message(msg: dict, server_msg) -> None:
    """LLM.chat's message is the server's: reasoning, content, calls (their ids are random)."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"] or []]
    assert calls == [(c.function.name, c.function.arguments) for c in server_msg.tool_calls or []]
    assert (msg["content"], msg.get("reasoning_content")) == (server_msg.content, server_msg.reasoning_content)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in msg["tool_calls"] or [])


@pytest.mark.slow
def test_llm_chat_reasoning_and_tool_calls_are_the_servers(qwen3_pair):
    """LLM.chat(tools=...) with a reasoning parser: a think block then a
    hermes call (forced by guided_choice, so the parsers read real engine
    output) splits into reasoning_content and a tool call as the server
    splits it; tool_choice="required" sampled with a seed gives the
    server's calls, their arguments valid under the tool's schema."""
    llm, client = qwen3_pair
    out = ('<think>\nParis, two days.\n</think>\n\n<tool_call>\n'
           + json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}) + "\n</tool_call>")
    got = llm.chat(ASK, SamplingParams(max_tokens=120, guided_choice=[out]), tools=TOOLS)[0].outputs[0]
    srv = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=120,
                                         extra_body={"guided_choice": [out]}).choices[0]
    assert got.message["reasoning_content"] == "\nParis, two days.\n" and not got.message["content"]
    assert json.loads(got.message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    same_message(got.message, srv.message)
    assert got.finish_reason == srv.finish_reason == "tool_calls"

    # the server fills what the body leaves out with the chat defaults: LLM.chat gets them too
    sp = dataclasses.replace(llm.get_default_sampling_params(chat=True), max_tokens=200, temperature=1.0, seed=11)
    got = llm.chat(ASK, sp, tools=TOOLS, tool_choice="required")[0].outputs[0]
    srv = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
                                         temperature=1.0, seed=11).choices[0]
    assert got.message["tool_calls"] and got.finish_reason == srv.finish_reason == "tool_calls"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in got.message["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    same_message(got.message, srv.message)
