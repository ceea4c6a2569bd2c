"""The bounds hostile input meets before any server or engine runs
(issue 13): SamplingParams.validate, the HTTP schema, the token budget.
The end-to-end checks against a real server are in test_reliability.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fdx.core.sampling_params import SamplingParams
from fdx.core.serving.protocol import MAX_JSON_DEPTH, APIError, ChatCompletionRequest, CompletionRequest
from fdx.core.serving.security import check_token_budget, is_loopback


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
