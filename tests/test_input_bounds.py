"""The bounds hostile input meets before any server or engine runs
(issue 13): SamplingParams.validate, the HTTP schema, the token budget.
The end-to-end checks against a real server are in test_reliability.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fdx.core.sampling_params import SamplingParams
from fdx.entrypoints.serving.protocol import MAX_JSON_DEPTH, APIError, ChatCompletionRequest, CompletionRequest
from fdx.entrypoints.serving.security import check_token_budget, is_loopback


@pytest.mark.parametrize("kw, field", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("-inf")}, "top_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"seed": -1}, "seed"), ({"seed": 2 ** 63}, "seed"), ({"seed": 10 ** 30}, "seed"),
    ({"top_k": 2 ** 31}, "top_k"), ({"max_tokens": 2 ** 64}, "max_tokens"), ({"min_tokens": 2 ** 64}, "min_tokens"),
    ({"stop": ["x"] * 129}, "stop"), ({"stop": ["x" * 4097]}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"), ({"stop_token_ids": [2 ** 31]}, "stop_token_ids"),
])
def test_sampling_params_refuse_hostile_values(kw, field):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}=") as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 300                    # a 10,000-item list is not echoed back whole


def test_sampling_params_keep_accepting_sane_values():
    sp = SamplingParams(temperature=np.float32(0.5), seed=2 ** 63 - 1, top_k=50, stop=["a"] * 128,
                        stop_token_ids=list(range(1024)), max_tokens=None)
    assert sp.seed == 2 ** 63 - 1 and len(sp.stop) == 128


def _body(raw: str, cls=CompletionRequest):
    return cls.model_validate(json.loads(raw))


def test_schema_refuses_nan_surrogates_nesting_and_roles():
    from pydantic import ValidationError
    for raw in ('{"prompt": "x", "temperature": NaN}', '{"prompt": "x", "top_p": Infinity}'):
        with pytest.raises(ValidationError, match="finite number"):
            _body(raw)
    with pytest.raises(APIError) as e:
        _body('{"prompt": ["ok", "bad \\ud800"]}')
    assert e.value.status == 400 and e.value.param == "prompt.1" and "lone surrogate" in e.value.message
    with pytest.raises(APIError) as e:
        _body('{"prompt": "x", "logit_bias": {"\\udc00": 1}}')      # in a key, too
    assert e.value.param == "logit_bias"
    deep = '{"prompt": "x", "metadata": ' + '{"a": ' * MAX_JSON_DEPTH + "1" + "}" * MAX_JSON_DEPTH + "}"
    with pytest.raises(APIError, match="nests deeper"):
        _body(deep)
    shallow = '{"prompt": "x", "metadata": ' + '{"a": ' * 10 + "1" + "}" * 10 + "}"
    assert _body(shallow).metadata is not None
    with pytest.raises(ValidationError, match="role"):
        _body('{"messages": [{"role": "wizard", "content": "hi"}]}', ChatCompletionRequest)
    assert _body('{"messages": [{"role": "developer", "content": "hi"}]}', ChatCompletionRequest)
    with pytest.raises(ValidationError, match="at most 1024 prompts"):
        CompletionRequest(prompt=[[1]] * 1025)
    assert len(CompletionRequest(prompt=list(range(5000))).prompt) == 5000   # token ids are not prompts


def test_token_budget_as_vllm_and_the_cap():
    sp = SamplingParams(max_tokens=100)
    assert check_token_budget(sp, [412], 512, None) is sp
    with pytest.raises(APIError) as e:
        check_token_budget(sp, [413], 512, None)
    assert e.value.code == "context_length_exceeded" and "513 tokens (413 in the prompt, 100" in e.value.message
    with pytest.raises(APIError) as e:
        check_token_budget(SamplingParams(max_tokens=100, n=3), [10, 10], 512, 599)   # 600 > 599
    assert e.value.code == "max_tokens_per_request" and e.value.param == "max_tokens"
    unset = SamplingParams(max_tokens=None, n=2)
    assert check_token_budget(unset, [10], 512, None).max_tokens is None
    assert check_token_budget(unset, [10], 512, 300).max_tokens == 150          # a share of the cap
    assert check_token_budget(unset, [500], 512, 300).max_tokens == 12          # ... within the context
    with pytest.raises(APIError):
        check_token_budget(SamplingParams(max_tokens=None, n=4), [10], 512, 3)


def test_loopback_addresses():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.8.8", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.com"]))


# -- issue 21: numbers the wire cannot carry, and the per-request limits (entrypoints/serving/edge.py)

def _edge_refusal(body: dict, vocab: int | None = 49152) -> APIError:
    """The APIError the edge answers ``body`` with (schema, then limits)."""
    from pydantic import ValidationError

    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving.edge import check_limits, validation_error
    try:
        req = CompletionRequest.model_validate(body)
    except APIError as e:                   # the schema's check_untrusted: an integer past 64 bits anywhere
        return e
    except ValidationError as e:
        resp = validation_error(e.errors(include_url=False))
        err = json.loads(resp.body)["error"]
        return APIError(resp.status_code, err["message"], param=err["param"])
    with pytest.raises(APIError) as e:
        check_limits(req, ServerConfig(), vocab)
    return e.value


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {str(10 ** 30): 1}}, "logit_bias"), ({"logit_bias": {"49152": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"), ({"logit_bias": {"1e3": 1}}, "logit_bias"),
    ({"allowed_token_ids": [10 ** 30]}, "allowed_token_ids.0"), ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
    ({"stop_token_ids": [49152]}, "stop_token_ids"),
    ({"extra_args": {"x": 10 ** 30}}, "extra_args"), ({"extra_args": {"x": [{"y": -10 ** 30}]}}, "extra_args"),
    ({"vllm_xargs": {"x": 2 ** 63}}, "vllm_xargs"),
    ({"max_tokens": True}, "max_tokens"), ({"n": True}, "n"), ({"seed": 1.0}, "seed"),
    ({"max_tokens": 10 ** 30}, "max_tokens"), ({"temperature": True}, "temperature"),
    ({"prompt": [True, 1]}, "prompt"),
])
def test_edge_refuses_numbers_the_wire_cannot_carry(extra, param):
    e = _edge_refusal({"prompt": "x", **extra})
    assert e.status == 400 and e.param and e.param.startswith(param.split(".")[0]), (e.param, e.message)
    assert len(e.message) < 400


def test_every_int_the_edge_passes_is_msgpack_encodable():
    import msgspec
    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving.edge import check_limits
    req = CompletionRequest(prompt="x", max_tokens=2 ** 63 - 1, seed=0, extra_args={"a": [-2 ** 63, 2 ** 63 - 1]},
                            logit_bias={"49151": 5}, allowed_token_ids=[0, 49151])
    check_limits(req, ServerConfig(), 49152)
    msgspec.msgpack.encode(req.model_dump())


@pytest.mark.parametrize("field, at_limit, past_limit", [
    ("bad_words", ["w%d" % i for i in range(256)], ["w%d" % i for i in range(257)]),
    ("bad_words", ["x" * 1024] * 64, ["x" * 1024] * 64 + ["y"]),                  # 64 KiB in all
    ("stop", ["s%d" % i for i in range(16)], ["s%d" % i for i in range(17)]),
    ("stop", ["s" * 1024], ["s" * 1025]),
    ("logit_bias", {str(i): 1 for i in range(1024)}, {str(i): 1 for i in range(1025)}),
    ("guided_choice", ["c%d" % i for i in range(1024)], ["c%d" % i for i in range(1025)]),
    ("guided_regex", "a" * 65536, "a" * 65537),
    ("guided_json", {"type": "string", "description": "d" * 65000}, {"type": "string", "description": "d" * 65536}),
    ("extra_args", {"k": "v" * 65000}, {"k": "v" * 65536}),
])
def test_edge_limits_refuse_one_past_and_pass_at_the_limit(field, at_limit, past_limit):
    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving.edge import check_limits
    check_limits(CompletionRequest(prompt="x", **{field: at_limit}), ServerConfig(), 49152)
    e = _edge_refusal({"prompt": "x", field: past_limit})
    assert e.status == 400 and e.param == field and e.code == "limit_exceeded"


def test_edge_limits_are_server_settings():
    from fdx.core.config import FdxConfig
    from fdx.entrypoints.serving.edge import check_limits
    sc = FdxConfig.build(**{"server.max_bad_words": 2}).server
    check_limits(CompletionRequest(prompt="x", bad_words=["a", "b"]), sc)
    with pytest.raises(APIError, match="at most 2 words"):
        check_limits(CompletionRequest(prompt="x", bad_words=["a", "b", "c"]), sc)


def test_router_body_parser_refuses_absurd_nesting_and_non_objects():
    from fdx.entrypoints.serving.edge import parse_json
    for raw in (b'{"extra_args": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001, b"[1]", b'"x"', b"\xff{",
                b'{"prompt": "x", "extra_args": ' + b'[' * 40 + b']' * 40 + b'}'):
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400
    assert parse_json(b'{"prompt": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}')["prompt"].startswith("[[")


def test_bad_words_tokenized_once_in_the_api_process_match_the_engines():
    from fdx.core.sampling_params import bad_word_sequences
    sp = SamplingParams(bad_words_token_ids=bad_word_sequences(lambda t: [ord(c) for c in t], ["ab", " c"]))
    assert sp.bad_words_token_ids == [[32, 97, 98], [32, 99], [97, 98]]
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[2 ** 40]])


# -- issue 35: integers anywhere, sizes before the schema, the refusal budget ----------------

@pytest.mark.parametrize("body, param, where", [
    ({"guided_json": {"type": "integer", "minimum": 10 ** 30}}, "guided_json", "guided_json.minimum"),
    ({"guided_json": {"enum": ["a", 10 ** 23]}}, "guided_json", "guided_json.enum.1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"maximum": -10 ** 20}}}},
     "response_format", "response_format.json_schema.schema.maximum"),
    ({"metadata": {"k": 2 ** 63}}, "metadata", "metadata.k"),
])
def test_every_integer_in_a_body_is_within_64_bits(body, param, where):
    import msgspec
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate({"prompt": "x", **body})
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(where + ":")
    ok = CompletionRequest.model_validate({"prompt": "x", "guided_json": {"minimum": -2 ** 63, "maximum": 2 ** 63 - 1}})
    msgspec.msgpack.encode(ok.model_dump())          # what passes, the wire carries


def test_field_sizes_are_refused_before_the_schema_on_any_type():
    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving.edge import check_sizes
    sc = ServerConfig()
    for body, param in [({"bad_words": ["w"] * 257}, "bad_words"), ({"bad_words": ["x" * 70000]}, "bad_words"),
                        ({"tools": [{}] * 257}, "tools"), ({"messages": [{}] * 4097}, "messages"),
                        ({"stop": ["s"] * 17}, "stop"), ({"guided_json": {"enum": ["v"] * 40000}}, "guided_json"),
                        ({"extra_args": {"k": ["v" * 100] * 1000}}, "extra_args")]:
        with pytest.raises(APIError) as e:
            check_sizes({"prompt": "x", **body}, sc)
        assert e.value.param == param and e.value.code == "limit_exceeded", body
    check_sizes({"bad_words": 5, "tools": "x", "stop": "s" * 5000}, sc)   # wrong types: the schema's to refuse
    # at the limits nothing is refused early (check_limits measures exactly later)
    check_sizes({"bad_words": ["x" * 1024] * 64, "guided_json": {"type": "string", "description": "d" * 65000}}, sc)


def test_refusal_budget_refills_and_is_per_client():
    from fdx.entrypoints.serving.edge import RefusalBudget
    b = RefusalBudget(rate=1000.0, burst=5000.0)
    a, other = ("10.0.0.1", None), ("10.0.0.2", None)
    assert b.wait_s(a, now=0.0) == 0.0
    b.charge(a, 4000, now=0.0)
    assert b.wait_s(a, now=0.0) == 0.0                # 1000 left
    b.charge(a, 4000, now=0.0)                        # -3000: limited for about 3 s
    assert 2.9 < b.wait_s(a, now=0.0) < 3.1 and b.wait_s(other, now=0.0) == 0.0
    assert b.wait_s(a, now=2.0) > 0 and b.wait_s(a, now=3.1) == 0.0
    b.charge(other, 10, now=0.0)                      # at least MIN_COST
    assert b._level(other, 0.0) == 5000 - RefusalBudget.MIN_COST
