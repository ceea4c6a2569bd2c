"""Tool calls and reasoning through `fdx serve` with the openai client, on a
tiny random Qwen3 with Qwen3's chat template, whose output is forced by
guided decoding (so the parsers read real engine output): auto (the hermes
parser), required, named, streaming, parallel, a tool round trip; the
qwen3 reasoning parser, enable_thinking, reasoning_max_tokens;
continuous_usage_stats. Then the engine's side alone (guided_starts_after
and the reasoning budget through LLM), and tool_choice="required" on the
default model (SmolLM2)."""
from __future__ import annotations

import json
import pathlib
import shutil

import httpx
import jsonschema
import openai
import pytest

from serve_utils import API_KEY, ServerProcess, ready_server

pytestmark = pytest.mark.slow

DATA = pathlib.Path(__file__).parent / "data"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
               "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "Weather in Paris for 2 days, and the time?"}]


def hermes(*calls) -> str:
    return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, tiny_checkpoints):
    src, _ = tiny_checkpoints["Qwen3ForCausalLM"]
    d = tmp_path_factory.mktemp("tiny_qwen3_tools")
    for f in pathlib.Path(src).iterdir():
        shutil.copy(f, d / f.name)
    shutil.copy(DATA / "qwen3_chat_template.jinja", d / "chat_template.jinja")
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024                 # room for the tools' system prompt and a history
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def server(tmp_path_factory, qwen3_dir):
    srv = ready_server(tmp_path_factory.mktemp("serve_tools"), model={"model": str(qwen3_dir), "max_model_len": 1024},
                        cache={"num_kv_blocks": 256}, decoding={"guided_backend": "llguidance"},
                        server={"tool_call_parser": "hermes", "enable_auto_tool_choice": True,
                                "reasoning_parser": "qwen3"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def check_calls(calls, names=None):
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in calls}) == len(calls)
    if names is not None:
        assert [c.function.name for c in calls] == names


def stream_calls(stream):
    """Assemble a streamed choice: (content, {index: [id, name, arguments, pieces]}, finish_reason, chunks)."""
    content, calls, reason, chunks = "", {}, None, []
    for chunk in stream:
        chunks.append(chunk)
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "the first piece of a call carries its id and name"
                calls[tc.index] = [tc.id, tc.function.name, "", 0]
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index][2] += tc.function.arguments or ""
            calls[tc.index][3] += bool(tc.function.arguments)
        reason = ch.finish_reason or reason
    return content, calls, reason, chunks


def test_auto_finds_the_hermes_calls_the_model_wrote(client):
    text = hermes(("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "UTC"}))
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=120,
                                       extra_body={"guided_choice": [text]})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    check_calls(c.message.tool_calls, ["get_weather", "get_time"])
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}

    # streamed: ids and names first, arguments in pieces, equal to the whole
    stream = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=120, stream=True,
                                            extra_body={"guided_choice": [text]})
    content, calls, reason, _ = stream_calls(stream)
    assert reason == "tool_calls" and not content.strip()
    assert [(v[1], v[2]) for _, v in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert all(v[3] > 1 for v in calls.values()), "arguments arrive in several pieces"


def test_auto_plain_answer_and_a_malformed_call_are_content(client):
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=60,
                                       extra_body={"guided_choice": ["It is sunny."]})
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    broken = "<tool_call>\nget_weather(Paris)\n</tool_call>"
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=60,
                                       extra_body={"guided_choice": [broken]})
    assert r.choices[0].message.content == broken and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_required_is_guaranteed_by_the_schema(client, stream):
    kw = dict(model=None, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, seed=11)
    if not stream:
        r = client.chat.completions.create(n=3, **kw)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            assert c.message.tool_calls
            check_calls(c.message.tool_calls)
        # qwen3 with a prompt that opens no think block: the schema holds from the first token, and a
        # reasoning budget has nothing to cut (it would fight the grammar)
        single = client.chat.completions.create(parallel_tool_calls=False, extra_body={"reasoning_max_tokens": 3},
                                                **kw)
        assert len(single.choices[0].message.tool_calls) == 1
        check_calls(single.choices[0].message.tool_calls)
    else:
        _, calls, reason, _ = stream_calls(client.chat.completions.create(stream=True, **kw))
        assert reason == "tool_calls" and calls
        for _, name, args, _ in calls.values():
            jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_named_function_streams_its_arguments(client):
    kw = dict(model=None, messages=ASK, tools=TOOLS, max_tokens=100, temperature=1.0, seed=5,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "stop"
    check_calls([call])
    _, calls, reason, _ = stream_calls(client.chat.completions.create(stream=True, **kw))
    (streamed,) = calls.values()
    assert streamed[1] == "get_weather" and streamed[3] > 1 and reason == "stop"
    assert streamed[2] == call.function.arguments          # same seed, same tokens


def test_tool_round_trip_renders_the_history(server, client, qwen3_dir):
    """The assistant's calls and the tool results go back through the chat
    template: the prompt fdx counts equals transformers' rendering of it."""
    import transformers
    first = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=2)
    calls = first.choices[0].message.tool_calls
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]}] + [
        {"role": "tool", "tool_call_id": c.id, "content": '{"ok": true}'} for c in calls]
    r = client.chat.completions.create(model=None, messages=history, tools=TOOLS, max_tokens=5,
                                       extra_body={"guided_choice": ["Done."]})
    assert r.choices[0].message.content == "Done."
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    ref = json.loads(json.dumps(history))
    ref[1]["content"] = ""
    for c in ref[1]["tool_calls"]:
        c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = tok.apply_chat_template(ref, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>" in text and calls[0].function.name in text
    assert r.usage.prompt_tokens == len(tok(text, add_special_tokens=False).input_ids)


def test_tokenize_renders_the_tools(server, qwen3_dir):
    """/tokenize with messages and tools (vLLM's field): the template renders
    the tools as chat completions do, transformers' token ids; a bad tool is
    a 400 naming tools."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    url, auth = server.base_url + "/tokenize", {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url, headers=auth, json={"messages": ASK, "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(ASK, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "get_weather" in text and r.json()["tokens"] == tok(text, add_special_tokens=False).input_ids
    plain = httpx.post(url, headers=auth, json={"messages": ASK}, timeout=30).json()["tokens"]
    assert len(plain) < len(r.json()["tokens"])
    r = httpx.post(url, headers=auth, json={"messages": ASK, "tools": [{"type": "function"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text


def test_reasoning_content_streamed_and_not(client):
    out = "<think>\nThe user wants weather. Paris is sunny.\n</think>\n\nSunny in Paris."
    r = client.chat.completions.create(model=None, messages=ASK, max_tokens=80, extra_body={"guided_choice": [out]})
    m = r.choices[0].message
    assert m.reasoning_content == "\nThe user wants weather. Paris is sunny.\n" and m.content == "\n\nSunny in Paris."
    stream = client.chat.completions.create(model=None, messages=ASK, max_tokens=80, stream=True,
                                            extra_body={"guided_choice": [out]})
    reasoning, content = "", ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (m.reasoning_content, m.content)


def test_enable_thinking_false_reaches_the_template(client, qwen3_dir):
    """Qwen3's template closes an empty think block when enable_thinking is
    false: the prompt is 4 tokens longer (as transformers renders it), and
    the parser reads all of the output as the answer."""
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir))
    out = "<think>x</think>y"
    kw = dict(model=None, messages=ASK, max_tokens=40, extra_body={"guided_choice": [out]})
    on = client.chat.completions.create(**kw)
    off = client.chat.completions.create(**{**kw, "extra_body": {"guided_choice": [out],
                                                                 "chat_template_kwargs": {"enable_thinking": False}}})
    ref = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert ref.endswith("<think>\n\n</think>\n\n")
    assert off.usage.prompt_tokens == len(tok(ref, add_special_tokens=False).input_ids) > on.usage.prompt_tokens
    assert (on.choices[0].message.reasoning_content, on.choices[0].message.content) == ("x", "y")
    assert (off.choices[0].message.reasoning_content, off.choices[0].message.content) == (None, out)


def test_reasoning_max_tokens_forces_the_end_of_thinking(client, qwen3_dir):
    import transformers
    end = transformers.AutoTokenizer.from_pretrained(str(qwen3_dir)).encode("</think>", add_special_tokens=False)
    r = client.chat.completions.create(model=None, messages=ASK, max_tokens=20, temperature=1.0, seed=4,
                                       logprobs=True, extra_body={"reasoning_max_tokens": 6, "ignore_eos": True})
    tokens = [t.token for t in r.choices[0].logprobs.content]
    assert len(tokens) == 20 and "".join(tokens[6:6 + len(end)]) == "</think>"
    assert "</think>" not in "".join(tokens[:6])


def test_continuous_usage_stats_on_every_chunk(client):
    stream = client.chat.completions.create(model=None, messages=ASK, max_tokens=8, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert all(ch.usage is not None for ch in chunks)
    done = [ch.usage.completion_tokens for ch in chunks]
    assert done == sorted(done) and done[-1] == 8 and done[0] == 0
    assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
    plain = list(client.chat.completions.create(model=None, messages=ASK, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
    assert [ch.usage for ch in plain[:-1]] == [None] * (len(plain) - 1) and plain[-1].usage.completion_tokens > 0


def test_bad_tool_requests_are_400_naming_the_field(server):
    def post(**body):
        return httpx.post(server.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    for body, param in [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools"),
                        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "required",
                          "response_format": {"type": "json_object"}}, "tool_choice"),
                        ({"reasoning_max_tokens": -1}, "reasoning_max_tokens"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
                          "tool_choice": "required"}, "tools")]:
        r = post(**body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    assert post().status_code == 200                      # still serving


def test_engine_starts_the_constraint_after_the_forced_end_of_thinking(tiny_checkpoints):
    """guided_starts_after with reasoning_max_tokens through LLM: 3 free
    tokens, the forced end tokens, then only a choice, then eos."""
    from fdx import LLM, SamplingParams
    path, _ = tiny_checkpoints["Qwen3ForCausalLM"]
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=32, block_size=16, progress=False,
              guided_backend="llguidance")
    end = llm.tokenizer.encode("</think>", add_special_tokens=False)
    sp = SamplingParams(temperature=1.0, seed=3, max_tokens=30, guided_choice=["yes", "no"],
                        guided_starts_after=end, reasoning_max_tokens=3, reasoning_end_token_ids=end)
    (out,) = llm.generate([{"prompt_token_ids": [5, 9, 200, 31]}], sp)
    ids = out.outputs[0].token_ids
    assert ids[3:3 + len(end)] == end and out.outputs[0].finish_reason == "stop"
    after = [t for t in ids[3 + len(end):] if t not in llm.tokenizer.eos_token_ids]
    assert llm.tokenizer.decode(after) in ("yes", "no")
    assert llm.tokenizer.decode(ids[:3]) not in ("yes", "no")      # the first tokens were free text
    (plain,) = llm.generate([{"prompt_token_ids": [5, 9, 200, 31]}],
                            SamplingParams(temperature=1.0, seed=3, max_tokens=30, guided_choice=["yes", "no"]))
    assert out.outputs[0].text.endswith(plain.outputs[0].text) or plain.outputs[0].text in ("yes", "no")


def test_required_on_the_default_model(tmp_path):
    """SmolLM2 (the embedded default) with tool_choice="required": the call
    parses and matches the schema; with no tool-call parser, "auto" is refused."""
    srv = ServerProcess(tmp_path, model={"max_model_len": 1024}, cache={"num_kv_blocks": 96},
                        decoding={"guided_backend": "llguidance"})
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
        r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS[:1], tool_choice="required",
                                           max_tokens=60, temperature=0)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        check_calls(c.message.tool_calls, ["get_weather"] * len(c.message.tool_calls))
        # this server has no tool-call parser: "auto" (the default with tools) is a 400 that says what to set
        r = httpx.post(srv.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"messages": ASK, "tools": TOOLS, "max_tokens": 4}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_outside_parsers_from_the_plugin_package(tmp_path, qwen3_dir, example_plugin_installed):
    """tests/plugin_pkg's tool and reasoning parsers (docs/plugins.md's
    contracts, nothing else), installed with pip and picked by config."""
    srv = ServerProcess(tmp_path, model={"model": str(qwen3_dir), "max_model_len": 1024}, cache={"num_kv_blocks": 96},
                        decoding={"guided_backend": "llguidance"},
                        server={"tool_call_parser": "example-actions", "enable_auto_tool_choice": True,
                                "reasoning_parser": "example-thoughts"})
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0)
        # the parser's model thinks first, so the forced answer starts after its [[/thought]]: a budget
        # of 0 writes that at once
        out = 'Checking.\nACTION get_weather {"city": "Oslo", "days": 1}'
        kw = dict(model=None, messages=ASK, tools=TOOLS, max_tokens=80,
                  extra_body={"guided_choice": [out], "reasoning_max_tokens": 0})
        m = client.chat.completions.create(**kw).choices[0]
        assert m.finish_reason == "tool_calls" and m.message.content == "Checking."
        assert m.message.reasoning_content is None
        check_calls(m.message.tool_calls, ["get_weather"])
        assert json.loads(m.message.tool_calls[0].function.arguments) == {"city": "Oslo", "days": 1}
        content, calls, reason, chunks = stream_calls(client.chat.completions.create(stream=True, **kw))
        reasoning = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in chunks if ch.choices)
        assert (reasoning, content, reason) == ("", "Checking.", "tool_calls")
        assert [(v[1], v[2]) for v in calls.values()] == [("get_weather", '{"city": "Oslo", "days": 1}')]

        # reasoning, then a guaranteed call: 5 free tokens, the forced [[/thought]], then the schema's array
        r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, temperature=1.0, seed=9, logprobs=True,
                                           extra_body={"reasoning_max_tokens": 5, "min_tokens": 5})
        c = r.choices[0]
        tokens = [t.token for t in c.logprobs.content]
        end = "[[/thought]]"
        forced = next(n for n in range(1, 10) if "".join(tokens[5:5 + n]) == end)
        assert c.message.reasoning_content == "".join(tokens[:5]) and c.message.content is None
        assert "".join(tokens[5 + forced:]).startswith("[") and c.finish_reason == "tool_calls"
        check_calls(c.message.tool_calls)
    finally:
        srv.stop()
