"""`fdx serve` end to end: one real server subprocess for the module, driven
with the official openai client (sync and async, streaming and not) and
checked against `LLM.generate` (the in-process engine) as the reference."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
from serve_utils import API_KEY, ServerProcess, pid_alive, wait_for

from fdx.core.output import SequenceState
from fdx.core.sampling_params import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, request):
    request.getfixturevalue("example_plugin_installed")      # its stop-after logits processor
    srv = ServerProcess(tmp_path_factory.mktemp("serve"), scheduler={"max_num_seqs": 4},
                        model={"quantization": "none"},                # smollm_llm's, the reference
                        cache={"num_kv_blocks": 128}, decoding={"logits_processors": ["stop-after"]},
                        server={"max_concurrency": 3, "max_queue": 2, "max_request_body_bytes": 65536,
                                "engine_death_grace_s": 3})
    try:
        request.getfixturevalue("smollm_llm")      # load the reference while the server loads
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def reference(llm, prompt, **kw):
    return llm.generate([prompt], SamplingParams(**kw))[0]


def sse_stream(http: httpx.Client, stack: contextlib.ExitStack, path: str, body: dict):
    """Open a streaming request; returns (status, iterator over parsed events)."""
    resp = stack.enter_context(http.stream("POST", path, json={**body, "stream": True}))
    if resp.status_code != 200:
        resp.read()
        return resp, None

    def events():
        for line in resp.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                yield "[DONE]" if data == "[DONE]" else json.loads(data)
    return resp, events()


def read_until_text(events, indices=(0,)) -> None:
    """Consume events until each choice index produced some text."""
    want = set(indices)
    for ev in events:
        for ch in ev.get("choices", []):
            if ch.get("text"):
                want.discard(ch["index"])
        if not want:
            return
    raise AssertionError("the stream ended early")


def idle(server) -> bool:
    m = server.metrics()
    return (m["fdx:num_requests_running"] == 0 and m["fdx:num_requests_waiting"] == 0
            and m["fdx:kv_cache_free_blocks"] == m["fdx:kv_cache_total_blocks"])


# -- the output processor, without a server -------------------------------------------------

def test_stop_string_is_held_back_while_streaming(smollm_llm):
    """The API side streams nothing a stop string later cuts: it holds back
    what may begin one until the engine says which token completed it (the
    engine's token processor runs TextOutput's rule, as here)."""
    from fdx.core.output import TextOutput
    tok = smollm_llm.tokenizer
    text = " Paris.\n\nThe answer is: 2018"
    ids = tok.encode(text, add_special_tokens=False)
    sp = SamplingParams(stop=["answer is"], max_tokens=50)
    engine_side = TextOutput(tok, sp)
    seq = SequenceState("r-0", 0, 0, [1], sp, tok)
    streamed, hit_at = "", None
    for i, t in enumerate(ids):
        stop = engine_side.add(t, i + 1)
        seq.add([t], "stop" if stop else None, stop)
        streamed += seq.take_text()
        assert " Paris.\n\nThe ".startswith(streamed), streamed     # never streams what gets cut
        if seq.finished:
            hit_at = i
            break
    assert streamed == seq.text == " Paris.\n\nThe "
    assert seq.finish_reason == "stop" and seq.stop_reason == "answer is"
    assert tok.decode(ids[: hit_at + 1]).endswith("answer is") and len(seq.token_ids) == hit_at + 1


def test_engine_side_params_carry_no_text_work():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


# -- endpoints -------------------------------------------------------------------------------

def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server.base_url + "/version").json()


def test_completion_greedy_matches_llm(server, client, smollm_llm):
    ref = reference(smollm_llm, PROMPT, temperature=0, max_tokens=12).outputs[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason == "length"
    n_prompt = len(smollm_llm.tokenizer.encode(PROMPT))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        n_prompt, len(ref.token_ids), n_prompt + len(ref.token_ids))
    # the same prompt as token ids, and echo
    ids = smollm_llm.tokenizer.encode(PROMPT)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, echo=True)
    assert r2.choices[0].text == smollm_llm.tokenizer.decode(ids, skip_special_tokens=False) + ref.text


def test_prompt_logprobs_over_http_equal_the_engine_in_process(server, client, smollm_llm):
    """lm-eval's loglikelihood request (echo, logprobs, max_tokens 0) and vLLM's
    prompt_logprobs: the prompt tokens' logprobs equal LLM.generate(...,
    prompt_logprobs=N) on the same float32 weights; nothing generated is shown."""
    prompt = "The capital of France is Paris. The capital of Spain is"
    ref = reference(smollm_llm, prompt, max_tokens=1, temperature=0.0, prompt_logprobs=2)
    ids, want = ref.prompt_token_ids, ref.prompt_logprobs
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(want[j][ids[j]].logprob, abs=1e-4), j
        assert len(lp.top_logprobs[j]) == 1
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]
    # with generated tokens: the prompt's entries, then the completion's, and the text after the prompt
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0, temperature=0)
    c, out = r.choices[0], reference(smollm_llm, prompt, max_tokens=3, temperature=0.0)
    assert c.text == prompt + out.outputs[0].text
    assert len(c.logprobs.tokens) == len(ids) + 3 and c.logprobs.token_logprobs[0] is None
    # streamed: the echo chunk carries the prompt's logprobs
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                            temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == c.logprobs.token_logprobs[1:len(ids)]
    # vLLM's prompt_logprobs: per choice on completions, at the top level on chat
    body = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                     extra_body={"prompt_logprobs": 2}).model_dump()
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for j in range(1, len(ids)):
        assert {int(t) for t in got[j]} == set(want[j]), j
        for t, e in got[j].items():
            assert e["logprob"] == pytest.approx(want[j][int(t)].logprob, abs=1e-4)
            assert e["rank"] == want[j][int(t)].rank
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0}).model_dump()
    assert chat["prompt_logprobs"][0] is None and all(len(e) >= 1 for e in chat["prompt_logprobs"][1:])
    # refused with the field named
    for kw, param in (({"max_tokens": 0}, "max_tokens"),
                      ({"max_tokens": 1, "stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
                      ({"max_tokens": 1, "extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, **kw)
        assert e.value.body["param"] == param, kw


def test_todays_structured_output_names_over_http(server, client, smollm_llm):
    """vLLM's structured_outputs body field, instructor 1.3's json_object with a
    schema, and a 400 naming an unknown key inside response_format or a
    stream_options without stream: from the README's install (guided decoding
    on by default)."""
    import jsonschema
    prompt = "My favourite city is"
    want = reference(smollm_llm, prompt, max_tokens=6, temperature=0.0, guided_regex="[A-Z][a-z]+",
                     guided_whitespace_flexible=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "[A-Z][a-z]+"}})
    assert r.choices[0].text == want.outputs[0].text and re.fullmatch("[A-Z][a-z]+", r.choices[0].text)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A city as JSON"}],
                                          max_tokens=40, temperature=0,
                                          response_format={"type": "json_object", "schema": schema})
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    for body, param in (({"response_format": {"type": "json_object", "scheme": {}}}, "response_format.scheme"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema, "x": 1}}},
                         "response_format.json_schema.x"),
                        ({"stream_options": {"include_usage": True}}, "stream_options"),
                        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs")):
        r = httpx.post(server.base_url + "/v1/chat/completions", headers=HEADERS, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_chat_stream_matches_llm(server, smollm_llm):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is 2+2?"}]
    # fields the request leaves out (the penalties, top_p) get the defaults, as in LLM.chat
    chat_defaults = smollm_llm.get_default_sampling_params(chat=True)
    ref = smollm_llm.chat(messages, dataclasses.replace(chat_defaults, temperature=0, max_tokens=10))[0].outputs[0]

    async def go():
        async with async_client(server) as c:
            stream = await c.chat.completions.create(
                model=MODEL, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
                stream_options={"include_usage": True})
            text, usage, finish, roles = "", None, None, []
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage
                for ch in chunk.choices:
                    roles += [ch.delta.role] if ch.delta.role else []
                    text += ch.delta.content or ""
                    finish = ch.finish_reason or finish
            return text, usage, finish, roles
    text, usage, finish, roles = asyncio.run(go())
    assert roles == ["assistant"]
    assert text == ref.text and finish == ref.finish_reason
    assert usage.completion_tokens == len(ref.token_ids)
    assert usage.prompt_tokens == len(smollm_llm.tokenizer.encode(
        smollm_llm.tokenizer.apply_chat_template(messages), add_special_tokens=False))


def test_chat_n2_seeded_sampling_matches_llm(server, smollm_llm):
    messages = [{"role": "user", "content": "Name a color."}]
    ref = smollm_llm.chat(messages, dataclasses.replace(smollm_llm.get_default_sampling_params(chat=True), n=2,
                                                        temperature=0.9, seed=11, max_tokens=8))[0].outputs

    async def go():
        async with async_client(server) as c:
            return await c.chat.completions.create(model=MODEL, messages=messages, n=2, temperature=0.9,
                                                   seed=11, max_tokens=8)
    r = asyncio.run(go())
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [o.text for o in ref]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for o in ref)


def test_chat_defaults_fill_only_the_fields_the_request_leaves_out(server, smollm_llm):
    """The sampling fields from the embedded model's defaults and fdx's chat
    defaults, then max_tokens too; LLM.chat is the reference."""
    defaults = smollm_llm.get_default_sampling_params(chat=True)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ref = smollm_llm.chat(messages, dataclasses.replace(defaults, temperature=0.7, seed=7, max_tokens=16))
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=HEADERS, timeout=300,
                   json={"messages": messages, "temperature": 0.7, "seed": 7, "max_tokens": 16})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref[0].outputs[0].text
    messages = [{"role": "user", "content": "Say hi."}]
    alone = smollm_llm.chat(messages)[0].outputs[0]          # no SamplingParams: every default
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=HEADERS, timeout=300,
                   json={"messages": messages})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == alone.text and choice["finish_reason"] == alone.finish_reason == "stop"


def test_stop_strings_match_llm(server, client, smollm_llm):
    base = reference(smollm_llm, PROMPT, temperature=0, max_tokens=12).outputs[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]       # may span tokens: exercises the hold-back
    assert stop and stop in base
    for include in (False, True):
        ref = reference(smollm_llm, PROMPT, temperature=0, max_tokens=12, stop=[stop],
                        include_stop_str_in_output=include).outputs[0]
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                           stop=[stop, "never-seen-stop"], stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"include_stop_str_in_output": include})
        text, finish, usage = "", None, None
        for chunk in stream:
            usage = chunk.usage or usage
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        assert text == ref.text and finish == ref.finish_reason == "stop"
        assert text.endswith(stop) if include else stop not in text
        assert usage.completion_tokens == len(ref.token_ids)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].text == base[: base.index(stop)] and r.choices[0].finish_reason == "stop"


def test_max_tokens_and_sampling_fields(server, client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=3, temperature=0.7,
        top_p=0.9, seed=3, presence_penalty=0.5, frequency_penalty=0.5, user="u1", logprobs=True, top_logprobs=2,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": True})
    ch = r.choices[0]
    assert r.usage.completion_tokens == 3 and ch.finish_reason == "length"
    assert len(ch.logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in ch.logprobs.content)
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=2, n=2, logprobs=1,
                                  extra_body={"stop_token_ids": [2]})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) for c in r.choices)


def test_per_request_plugin_arguments_and_logit_bias_over_http(server, client, smollm_llm):
    """extra_args (and vLLM's vllm_xargs) reach an outside logits processor
    unchanged; OpenAI's logit_bias and allowed_token_ids work as in LLM."""
    for key in ("extra_args", "vllm_xargs"):
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={key: {"stop_after": 3}})
        assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "stop"
    ids = smollm_llm.tokenizer.encode(PROMPT)
    ref = smollm_llm.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0, max_tokens=4, logit_bias={12: 30.0}, allowed_token_ids=[12, 13, 14, 28]))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0, logit_bias={"12": 30},
                                  extra_body={"allowed_token_ids": [12, 13, 14, 28]})
    assert r.choices[0].text == ref.text and set(ref.token_ids) <= {12, 13, 14, 28}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"extra_args": {"stop_after": -1}})
    assert "stop_after" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 500})
    assert "logit_bias" in error_of(e)["message"]


def error_of(exc_info) -> dict:
    body = exc_info.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_error_codes(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=3)
    assert error_of(e)["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=2)
    assert error_of(e)["code"] == "context_length_exceeded" and "512" in error_of(e)["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"bogus_field": 1})
    assert error_of(e)["param"] == "bogus_field"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "json_bogus"})
    assert "json_bogus" in error_of(e)["message"] and error_of(e)["param"] == "response_format"
    for bad in ({"temperature": -1}, {"n": 0}, {"max_tokens": 0}, {"prompt": ""}, {"prompt": [10 ** 7]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{"model": MODEL, "prompt": PROMPT, **bad})
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert error_of(e)["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.models.list()
    assert error_of(e)["type"] == "authentication_error"
    assert httpx.post(server.base_url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    r = httpx.post(server.base_url + "/v1/completions", headers=HEADERS, content=b"{not json",
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("the request body is not valid JSON")
    r = httpx.post(server.base_url + "/v1/completions", headers=HEADERS,
                   json={"model": MODEL, "prompt": "x " * 40000}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_429_past_max_concurrency_and_full_queue(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 250, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        with contextlib.ExitStack() as stack:                 # max_concurrency = 3
            held = []                                         # (a collected stream closes its connection)
            for _ in range(3):
                resp, events = sse_stream(http, stack, "/v1/completions", body)
                assert resp.status_code == 200
                read_until_text(events)
                held.append(events)
            resp, _ = sse_stream(http, stack, "/v1/completions", body)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "max_concurrency"
        wait_for(lambda: idle(server), what="aborts to free the engine")
        with contextlib.ExitStack() as stack:                 # max_num_seqs = 4, max_queue = 2
            resp, events = sse_stream(http, stack, "/v1/completions", {**body, "n": 4})
            read_until_text(events, indices=range(4))         # all four running
            resp, _ = sse_stream(http, stack, "/v1/completions", {**body, "n": 2})
            assert resp.status_code == 200                    # two queued: the queue is full
            resp, _ = sse_stream(http, stack, "/v1/completions", body)
            assert resp.status_code == 429 and resp.json()["error"]["code"] == "queue_full"
    wait_for(lambda: idle(server), what="aborts to free the engine")


def test_disconnect_aborts_and_frees_blocks(server):
    before = server.metrics().get('fdx:request_success_total{finished_reason="abort",model_name="%s"}' % MODEL, 0)
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        with contextlib.ExitStack() as stack:
            _, events = sse_stream(http, stack, "/v1/completions",
                                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True})
            read_until_text(events)
            m = server.metrics()
            assert m["fdx:kv_cache_free_blocks"] < m["fdx:kv_cache_total_blocks"]
            assert m["fdx:num_requests_running"] == 1
        # the client hung up mid-stream
    wait_for(lambda: idle(server), what="the aborted request's blocks to be freed")
    abort_key = 'fdx:request_success_total{finished_reason="abort",model_name="%s"}' % MODEL
    assert server.metrics()[abort_key] == before + 1
    # a client that gives up on a non-streamed answer
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", headers=HEADERS, timeout=1.5,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True})
    wait_for(lambda: idle(server) and server.metrics()[abort_key] == before + 2,
             what="the abandoned request to be aborted")


def test_metrics_names(server):
    m = server.metrics()
    for name in ("fdx:num_requests_running", "fdx:num_requests_waiting", "fdx:kv_cache_usage_perc",
                 "fdx:prompt_tokens_total", "fdx:generation_tokens_total", "fdx:request_success_total",
                 "fdx:time_to_first_token_seconds_bucket", "fdx:time_per_output_token_seconds_bucket",
                 "fdx:e2e_request_latency_seconds_bucket", "fdx:request_queue_time_seconds_bucket"):
        assert name in m, name
    assert m["fdx:generation_tokens_total"] > 0 and m["fdx:prompt_tokens_total"] > 0
    finished = sum(v for k, v in m.items() if k.startswith("fdx:request_success_total{"))
    assert m["fdx:e2e_request_latency_seconds_count"] == finished > 0
    # sequences aborted while queued never had a first token
    assert 0 < m["fdx:time_to_first_token_seconds_count"] <= finished


def test_engine_death_gives_503_and_exit(server):
    """Last in the module: it takes the server down."""
    engine = server.engine_pid()
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=30) as http:
        with contextlib.ExitStack() as stack:
            _, events = sse_stream(http, stack, "/v1/completions",
                                   {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "ignore_eos": True})
            read_until_text(events)
            os.kill(engine, signal.SIGKILL)
            t0 = time.monotonic()
            rest = list(events)                               # the stream must end, with an error
            assert time.monotonic() - t0 < 60                # no hang (a minute)
            assert any(isinstance(e, dict) and "error" in e for e in rest)
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert server.proc.wait(30) == 1
    assert not pid_alive(engine)
