"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info``, in
vLLM's shapes (behind the API key, like /v1): a prompt, or chat messages
through the model's template (with the ``tools`` it renders, as chat
completions), into token ids with their count and
``max_model_len``; token ids back into text; the special tokens and chat
template."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from fdx.entrypoints.serving.protocol import APIError, ChatMessage, TokenId, _Model


class TokenizeCompletionRequest(_Model):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Model):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False          # the template holds them already (vLLM's default)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the template, as chat completions do (vLLM's)
    return_token_strs: bool = False
    content_special_tokens: Literal["parse", "text"] | None = None   # as in chat completions


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[TokenId]


def _ready(server):
    if server.render is None:
        raise APIError(503, "the server is not accepting requests (starting or shutting down)",
                       type="service_unavailable", code="loading")
    return server.render


def install(app, server) -> None:
    @app.post("/tokenize")
    async def tokenize(http_request: Request):
        from fdx.entrypoints.serving.edge import check_sizes, parse_json, read_body, validation_error
        from pydantic import ValidationError
        raw = await read_body(http_request)
        data = parse_json(raw, http_request.headers.get("content-type"))
        check_sizes(data, server.sc)
        kind = TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest
        try:
            req = kind.model_validate(data)
        except ValidationError as e:
            return validation_error(e.errors())
        server.check_model(req.model)
        render = _ready(server)
        if isinstance(req, TokenizeChatRequest):
            if req.tools:                 # the chat completions' checks of each tool (a 400 naming tools)
                from types import SimpleNamespace

                from fdx.core.chat_output import ChatRequestError, tool_plan
                try:
                    tool_plan(SimpleNamespace(tools=req.tools, tool_choice="none", parallel_tool_calls=None),
                              server.sc)
                except ChatRequestError as e:
                    raise APIError(400, e.message, param=e.param) from None
            text, ids = render.chat_prompt(req, server.content_as_text(req))
            if req.add_special_tokens:
                ids = render._encode(text, "messages", add_special_tokens=True)
        else:
            ids = render._encode(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        strs = render.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the special tokens and chat template (lm-eval's remote
        tokenizer reads them, then tokenizes through /tokenize: no tokenizer
        download on the client's side)."""
        tok = _ready(server).tokenizer
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": tok.chat_template,
                "model_max_length": server.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        render = _ready(server)
        bad = [t for t in req.tokens if t >= server.vocab_size]
        if bad:
            raise APIError(400, f"token ids must be in [0, {server.vocab_size}); got {bad[0]}", param="tokens")
        return {"prompt": render.tokenizer.decode(req.tokens, skip_special_tokens=False)}
