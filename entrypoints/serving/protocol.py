"""The OpenAI-compatible HTTP schema (pydantic, at the edge only).

Requests are validated here; unknown fields are rejected by name, and
OpenAI fields that fdx does not implement yet are rejected with a message
that says so rather than silently ignored.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

MAX_JSON_DEPTH = 32            # deeper nesting anywhere in a request body: 400
MAX_PROMPTS = 1024             # prompts in one completion request (checked before tokenizing)
INT64 = (-2**63, 2**63)        # the integers a body may hold anywhere (check_untrusted)

# numbers as JSON sent them: no bool taken as 1, no 1.0 or "5" taken as an integer, and every
# integer within 64 bits (msgpack carries no more; entrypoints/serving/edge.py checks vocabulary ranges)
Int = Annotated[int, Strict(), Field(ge=-2**63, lt=2**63)]
AnyInt = Annotated[int, Strict()]    # ranged later, where the message can say more (vocabulary, 2**31)
TokenId = Annotated[int, Strict(), Field(ge=0, lt=2**31)]
Num = Annotated[float, Strict()]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def check_untrusted(data: Any) -> None:
    """Reject, naming where, text that is not Unicode (a lone surrogate
    sent as a ``\\ud800`` escape; tokenizers and JSON encoders fail on it),
    nesting deeper than MAX_JSON_DEPTH, and any integer outside 64 bits,
    wherever it is (a schema's ``minimum``, an ``enum`` value, a tool's
    parameters, extra_args: msgpack carries no more, and the engine process
    must never see a body it cannot decode). Iterative: no recursion to
    exhaust."""
    stack = [(data, (), 0)]
    while stack:
        obj, path, depth = stack.pop()
        where = ".".join(str(p) for p in path) or None
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request nests deeper than {MAX_JSON_DEPTH} levels (at {where})",
                           param=path[0] if path else None)
        if isinstance(obj, str):
            try:
                obj.encode("utf-8")
            except UnicodeEncodeError as e:
                raise APIError(400, f"{where or 'the body'}: the text holds a lone surrogate "
                               f"({obj[e.start]!r} at index {e.start}), which is not valid Unicode",
                               param=where) from None
        elif isinstance(obj, dict):
            for k, v in obj.items():
                stack.append((k, path, depth + 1))
                if isinstance(v, (str, dict, list)) or type(v) is int and not INT64[0] <= v < INT64[1]:
                    stack.append((v, path + (k,), depth + 1))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                if isinstance(v, (str, dict, list)) or type(v) is int and not INT64[0] <= v < INT64[1]:
                    stack.append((v, path + (i,), depth + 1))
        elif type(obj) is int:                     # only out-of-range ones are pushed
            digits = str(obj) if abs(obj) < 10**60 else f"{'-' if obj < 0 else ''}a {len(str(abs(obj)))}-digit number"
            raise APIError(400, f"{where}: the integer {digits} is outside the 64-bit range "
                           f"[-2**63, 2**63) that fdx carries", param=str(path[0]) if path else None,
                           code="integer_out_of_range")


class _Model(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are not numbers a request may carry
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingRequest(_Model):
    model: str | None = None
    max_tokens: Int | None = None
    temperature: Num | None = None
    top_p: Num | None = None
    top_k: Int | None = None
    min_p: Num | None = None
    n: Int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[AnyInt] | None = None
    seed: Int | None = None
    presence_penalty: Num | None = None
    frequency_penalty: Num | None = None
    repetition_penalty: Num | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: Int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    logit_bias: dict[str, Num] | None = None          # OpenAI's: token id (as a string) -> bias
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    # per-request arguments for logits-processor plugins (SamplingParams.extra_args);
    # vllm_xargs is vLLM's name for the same thing
    extra_args: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    # structured output: OpenAI's response_format, or one of the guided_* extra body keys (docs/guided.md)
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_json_object: bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None
    guided_whitespace_flexible: bool | None = None
    # activation hooks (SamplingParams.activations, docs/research.md): checked in sampling_kwargs
    activations: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's (>= 0.12) name: {json | regex | choice | grammar |
                                                      # json_object | structural_tag, disable_any_whitespace}
    prompt_logprobs: Int | None = None                # vLLM's: top-N logprobs of each prompt token (0..20)
    # OpenAI fields with no effect here: accepted and ignored
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _untrusted(cls, data: Any) -> Any:
        check_untrusted(data)                     # raises APIError (a 400), not a validation error
        return data

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for a field set to something fdx cannot do."""
        if self.extra_args is not None and self.vllm_xargs is not None:
            return ("extra_args", "send per-request plugin arguments as extra_args or vllm_xargs, not both")
        if self.stream_options is not None and not self.stream:
            return ("stream_options", "stream_options is only allowed with stream=true (as in vLLM and OpenAI)")
        if self.prompt_logprobs is not None and self.stream:
            return ("prompt_logprobs", "prompt_logprobs is not supported with stream=true (as in vLLM)")
        return None

    def sampling_kwargs(self, max_tokens: int | None) -> dict[str, Any]:
        """SamplingParams keyword arguments (unset fields keep its defaults)."""
        kw: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens,
                              "ignore_eos": self.ignore_eos, "seed": self.seed,
                              "include_stop_str_in_output": self.include_stop_str_in_output,
                              "skip_special_tokens": self.skip_special_tokens}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "stop_token_ids", "logit_bias",
                     "allowed_token_ids", "bad_words", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        if self.stop is not None:
            kw["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        extra = self.extra_args if self.extra_args is not None else self.vllm_xargs
        if extra is not None:
            kw["extra_args"] = extra
        for name in ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar",
                     "structural_tag", "guided_whitespace_flexible"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        from_format = self.response_format_kwargs()
        both = [k for k in kw if k.startswith(("guided_", "structural_tag")) and k != "guided_whitespace_flexible"
                and kw[k] not in (None, False)]
        if from_format and both:
            raise APIError(400, f"response_format and {', '.join(both)}: a request takes at most one guided "
                           "decoding constraint", param="response_format")
        kw.update(from_format)
        if self.activations is not None:          # captures come back in the response: bounded (docs/serving.md)
            from fdx.core.activations import check_http_bounds
            try:
                check_http_bounds(self.activations)
            except ValueError as e:
                raise APIError(400, str(e), param="activations") from None
            kw["activations"] = self.activations
        if self.structured_outputs is not None:
            if from_format or both:
                raise APIError(400, f"structured_outputs and {'response_format' if from_format else both[0]}: a "
                               "request takes at most one guided decoding constraint", param="structured_outputs")
            kw["structured_outputs"] = self.structured_outputs
        return kw

    def response_format_kwargs(self) -> dict[str, Any]:
        """OpenAI's response_format as guided-decoding SamplingParams fields
        (APIError 400 for a malformed one)."""
        rf = self.response_format
        if rf is None:
            return {}
        kind = rf.get("type", "text")

        def only(where: dict, keys: set[str], name: str) -> None:     # an unknown key is a 400, as at the top
            unknown = sorted(set(where) - keys)
            if unknown:
                raise APIError(400, f"{name}.{unknown[0]}: unknown key (known: {', '.join(sorted(keys))})",
                               param=f"{name}.{unknown[0]}")

        if kind == "text":
            only(rf, {"type"}, "response_format")
            return {}
        if kind == "json_object":                 # instructor 1.3 sends its schema here: honoured
            only(rf, {"type", "schema"}, "response_format")
            schema = rf.get("schema")
            if schema is None:
                return {"guided_json_object": True}
            if not isinstance(schema, dict):
                raise APIError(400, "response_format.schema must be a JSON schema object",
                               param="response_format.schema")
            return {"guided_json": schema}
        if kind == "json_schema":
            only(rf, {"type", "json_schema"}, "response_format")
            spec = rf.get("json_schema")
            if isinstance(spec, dict):
                only(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object "
                               "(strict is always on: the output follows the schema)", param="response_format")
            return {"guided_json": schema}
        if kind == "structural_tag":
            return {"structural_tag": {k: v for k, v in rf.items() if k != "type"}}
        raise APIError(400, f"response_format type {kind!r} is not one of text, json_object, json_schema, "
                       "structural_tag", param="response_format")


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[AnyInt] | list[list[AnyInt]]
    echo: bool = False
    logprobs: Int | None = None
    suffix: str | None = None          # fill-in-the-middle, for tokenizers with FIM tokens (app.fim_prompt)
    best_of: Int | None = None         # best_of candidates, the n best by cumulative logprob returned
    use_beam_search: bool = False      # vLLM's: n beams (core/beam_search.py), best first
    length_penalty: Num = 1.0          # vLLM's: beam search's ranking exponent on the length

    @field_validator("prompt")
    @classmethod
    def _few_prompts(cls, v):
        if isinstance(v, list) and v and not isinstance(v[0], int) and len(v) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(v)}")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix and self.echo:
            return ("suffix", "suffix (fill in the middle) cannot be combined with echo")
        if self.best_of is not None:
            if self.best_of < self.n:
                return ("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
            if self.best_of > self.n and self.stream:
                return ("best_of", "best_of greater than n cannot be streamed (as in OpenAI)")
            if self.best_of > self.n and self.use_beam_search:
                return ("best_of", "with use_beam_search, n is the beam width: leave best_of out")
        if self.use_beam_search:
            for name, bad in (("stream", self.stream), ("echo", self.echo), ("logprobs", self.logprobs is not None),
                              ("prompt_logprobs", self.prompt_logprobs is not None), ("suffix", bool(self.suffix))):
                if bad:
                    return (name, f"{name} is not supported with use_beam_search")
        elif self.length_penalty != 1.0:
            return ("length_penalty", "length_penalty ranks beams: it needs use_beam_search=true")
        if self.max_tokens == 0 and not self.echo:
            return ("max_tokens", "max_tokens 0 scores the prompt without generating: it needs echo=true")
        return super().unsupported()

    def scores_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated (lm-eval's
        loglikelihood requests)."""
        return self.echo and self.max_tokens == 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")      # name, tool_call_id, ...: passed to the template
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"message content part of type {part.get('type')!r} is not supported: "
                               "only text parts ({'type': 'text', 'text': ...})", param="messages")
            parts.append(part["text"])
        return "\n".join(parts)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None          # checked in core/chat_output.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_max_tokens: Int | None = None            # FastDeploy's: the think block closes after this many
    # special-token text in message content: "text" encodes it as plain text (docs/security.md); "parse"
    # (vLLM's behaviour) as special tokens, unless the server's content_special_tokens is "text"
    content_special_tokens: Literal["parse", "text"] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.reasoning_max_tokens is not None and self.reasoning_max_tokens < 0:
            return ("reasoning_max_tokens", "reasoning_max_tokens must be >= 0")
        if self.top_logprobs is not None and not self.logprobs:
            return ("top_logprobs", "top_logprobs needs logprobs=true")
        return super().unsupported()
