"""Client libraries nobody here wrote, unchanged, against a real `fdx serve`
on loopback (issue 38, "How it is checked"): the openai SDK's tool round
trip (tool_choice required and named, streamed and not), instructor's TOOLS
and JSON_SCHEMA modes, langchain-openai's with_structured_output and
bind_tools(tool_choice=...), openai-agents with a function tool over chat
completions. The server is the embedded default model with the README's
install and no guided-decoding setting (decoding.guided_backend auto).

Every structured result is validated (pydantic in the clients, jsonschema
here): output that does not follow the schema fails the test. Nothing
touches the internet (openai-agents' tracing is off)."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from serve_utils import API_KEY, openai_client, serving

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ASK = "What is the weather in Paris for the next 2 days?"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast for a city",
                                           "parameters": WEATHER}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


class Weather(BaseModel):
    """A forecast request."""
    city: Literal["Paris", "Rome", "Oslo"]
    days: int = Field(ge=1, le=7)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("real_clients"), model={"max_model_len": 1024},
                 cache={"num_kv_blocks": 128}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def streamed_call(stream) -> tuple[str, str, str, str]:
    """(id, name, arguments, finish_reason) of the one tool call a stream holds."""
    ids, names, args, reason = set(), [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                assert call.index == 0
                if call.id:
                    ids.add(call.id)
                if call.function.name:
                    names.append(call.function.name)
                args.append(call.function.arguments or "")
            reason = choice.finish_reason or reason
    assert len(ids) == 1 and len(names) == 1, (ids, names)
    return ids.pop(), names[0], "".join(args), reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_openai_sdk_tool_round_trip(server, client, tool_choice):
    """A forced call (its arguments follow the schema; streamed equal to not
    streamed), then the tool's result sent back and answered."""
    messages = [{"role": "user", "content": ASK}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                       max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop"), choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice,
                                            max_tokens=60, temperature=0, stream=True)
    _, name, args, reason = streamed_call(stream)
    assert (name, args, reason) == ("get_weather", call.function.arguments, choice.finish_reason)
    # the round trip: the call and its result in the history, answered in text
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25 C"}]
    rendered = httpx.post(server.base_url + "/tokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"messages": messages}, timeout=30).json()["tokens"]
    prompt = httpx.post(server.base_url + "/detokenize", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"tokens": rendered}, timeout=30).json()["prompt"]
    assert "sunny, 25 C" in prompt
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=12, temperature=0)
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].message.content
    assert answer.usage.prompt_tokens >= len(rendered)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(client, mode):
    import instructor
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    got = patched.chat.completions.create(model=MODEL, response_model=Weather, max_retries=0, max_tokens=60,
                                          temperature=0, messages=[{"role": "user", "content": ASK}])
    assert isinstance(got, Weather)                  # instructor validated it (an invalid one raises)


@pytest.fixture(scope="module")
def chat_model(server):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, model=MODEL, temperature=0,
                      max_tokens=60, max_retries=0, timeout=300)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    got = chat_model.with_structured_output(Weather, method=method).invoke(ASK)
    assert isinstance(got, Weather), got             # langchain's parser validated it (an invalid one raises)


@pytest.mark.parametrize("tool_choice", ["get_weather", "any", "required"])
def test_langchain_bind_tools(chat_model, tool_choice):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """the forecast for a city"""
        return "sunny"

    msg = chat_model.bind_tools([get_weather], tool_choice=tool_choice).invoke(ASK)
    assert not msg.invalid_tool_calls and len(msg.tool_calls) >= 1, msg
    for call in msg.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
        get_weather.invoke(call["args"])             # the tool accepts them (pydantic validates)


def test_openai_agents_function_tool(server):
    """An Agent over chat completions (OpenAIChatCompletionsModel; the SDK's
    default is the Responses API) with a required function tool: the SDK runs
    the tool with the arguments the server produced and ends on its result."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                        set_tracing_disabled)
    set_tracing_disabled(True)                       # its exporter would call api.openai.com
    calls = []

    @function_tool
    def get_weather(city: Literal["Paris", "Rome", "Oslo"], days: int) -> str:
        """the forecast for a city"""
        calls.append((city, days))
        return f"sunny in {city}"

    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=300))
    agent = Agent(name="forecaster", instructions="Answer with the tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, ASK, max_turns=2)
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0][0]}"


def test_suffix_without_fim_tokens_is_a_400_naming_it(client):
    """SmolLM2's tokenizer has no fill-in-the-middle tokens."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="def f():", suffix="\nreturn 1", max_tokens=4)
    assert e.value.body["param"] == "suffix" and "FIM" in e.value.body["message"]


def test_requests_while_loading_are_503_not_500(tmp_path, tiny_checkpoints):
    """A client that calls before /health is ready gets the 503 'loading'
    (which the SDKs retry), not a 500 from a prompt rendered with no tokenizer."""
    from serve_utils import ServerProcess, wait_for
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    srv = ServerProcess(tmp_path, model={"model": str(path)})
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def health() -> int | None:
        try:
            return httpx.get(srv.base_url + "/health", timeout=2).status_code
        except httpx.HTTPError:
            return None
    try:
        wait_for(lambda: health() is not None, timeout=120, what="the server's port")
        answers = [httpx.post(srv.base_url + path, headers=headers, timeout=30, json=body).status_code
                   for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                      ("/v1/completions", {"prompt": "hi"}))]
        loaded = health() == 200
        assert all(code == 503 for code in answers) or loaded, answers
        assert 500 not in answers
    finally:
        srv.stop()
