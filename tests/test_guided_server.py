"""Guided decoding through `fdx serve` with the openai client: response_format
and the guided_* body keys, streaming, n > 1, and 400s that leave the server
serving."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from serve_utils import API_KEY, ready_server

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "temp": {"type": "integer", "minimum": -30, "maximum": 45},
    "sky": {"enum": ["clear", "cloudy", "rain"]},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23},
              "minItems": 1, "maxItems": 3}},
    "required": ["city", "temp", "sky", "hours"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_checkpoints):
    path, _ = tiny_checkpoints["Qwen2ForCausalLM"]
    srv = ready_server(tmp_path_factory.mktemp("serve_guided"), model={"model": str(path), "max_model_len": 384},
                        cache={"num_kv_blocks": 200}, decoding={"guided_backend": "llguidance"})
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(client, **kw):
    return client.chat.completions.create(model=None, messages=[{"role": "user", "content": "weather?"}],
                                          max_tokens=150, temperature=1.0, seed=3, **kw)


def test_response_format_json_schema_and_json_object(client):
    r = chat(client, n=3, response_format={"type": "json_schema",
                                           "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_guided_body_keys_on_completions(client):
    r = client.completions.create(model=None, prompt="x", max_tokens=30, temperature=1.0, seed=1, n=2,
                                  extra_body={"guided_regex": r"[0-9]{2}:[0-9]{2} (am|pm)"})
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{2}:[0-9]{2} (am|pm)", c.text), c.text
    r = client.completions.create(model=None, prompt="y", max_tokens=10, temperature=1.0,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right") and r.choices[0].finish_reason == "stop"


def test_stream_is_valid_json(client):
    stream = chat(client, stream=True, response_format={"type": "json_schema",
                                                        "json_schema": {"name": "w", "schema": SCHEMA}})
    text, reason = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_constraints_are_400_before_any_stream(server, client):
    http = httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format", "nope"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, None, "guided_regex, guided_choice"),
        ({"guided_json": {"type": "object"}, "response_format": {"type": "json_object"}}, "response_format",
         "at most one"),
        ({"structural_tag": {"structures": [], "triggers": []}}, "structural_tag", "xgrammar does"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
         "json_schema.schema"),
    ]
    for extra, param, text in cases:
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert text in err["message"] and err["param"] == param, err
    # and it keeps serving, constrained or not
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert client.completions.create(model=None, prompt="z", max_tokens=3).choices[0].text is not None
