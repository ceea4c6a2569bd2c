"""Chat requests with tools and thinking: what the request asks for (the
tool plan: which calls, and the guided constraint that guarantees them),
and each choice's output parsers (reasoning first, then tool calls) as
OpenAI's message fields and stream deltas. One implementation for the
server (entrypoints/serving/app.py) and ``LLM.chat(..., tools=...)``.

The seam with the output path is ``ChoiceOutput``: one per choice, fed
the choice's text deltas (``stream``) or its whole text (``message``). It
knows nothing about HTTP or the engine. A bad request raises
``ChatRequestError`` naming the field (the server answers it with a 400).
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from fdx.core.interfaces import ReasoningParser, ToolParser


class ChatRequestError(ValueError):
    """A chat request's tools, tool_choice or reasoning fields ask for what
    this server or LLM cannot do; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolPlan:
    """What a request's ``tools`` / ``tool_choice`` ask for."""
    mode: str                            # "none", "auto", "required" or "named"
    tools: list[dict] = field(default_factory=list)
    name: str | None = None              # the function of a named tool_choice
    parallel: bool = True                # parallel_tool_calls

    def guided_json(self) -> dict | None:
        """The JSON schema that guarantees the calls (required: an array of
        {name, parameters}; named: the function's parameters)."""
        if self.mode == "named":
            return self.parameters(self.name)
        if self.mode != "required":
            return None
        variants = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                      "parameters": self.parameters(f["name"])},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for f in self.functions()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def functions(self) -> list[dict]:
        return [t["function"] for t in self.tools]

    def parameters(self, name: str | None) -> dict:
        for f in self.functions():
            if f["name"] == name:
                params = f.get("parameters")
                return params if params else {"type": "object", "properties": {}}
        raise KeyError(name)


def tool_plan(req, sc) -> ToolPlan:
    """Check ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (APIError
    400 naming the field) and say what they ask for."""
    tools, choice = req.tools, req.tool_choice
    if not tools:                             # none, or an empty list
        if choice not in (None, "none"):
            raise ChatRequestError("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ChatRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                           "'parameters': {...}}}}", param="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise ChatRequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise ChatRequestError("tools: two functions have the same name", param="tools")
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ChatRequestError("tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if name not in names:
            raise ChatRequestError(f"tool_choice names the function {name!r}, which is not among tools "
                           f"({', '.join(names)})", param="tool_choice")
        return ToolPlan("named", tools, name, parallel)
    if choice in (None, "auto"):
        if not (sc.enable_auto_tool_choice and sc.tool_call_parser):
            raise ChatRequestError('"auto" tool choice needs the server started with --enable-auto-tool-choice '
                           "and --tool-call-parser (server.enable_auto_tool_choice, server.tool_call_parser); "
                           'tool_choice "required" or a named function work without them (through guided '
                           "decoding, on by default: decoding.guided_backend auto)",
                           param="tool_choice")
        return ToolPlan("auto", tools, None, parallel)
    if choice in ("none", "required"):
        return ToolPlan(choice, tools, None, parallel)
    raise ChatRequestError(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                   param="tool_choice")


class ChoiceOutput:
    """One choice's parsers: its text -> reasoning_content, content and
    tool_calls. ``reasoning`` (a ReasoningParser, its ``begin`` called) runs
    first; what it calls content goes on to the tool step: the ToolParser
    (``auto``), the JSON array of calls (``required``) or the named
    function's arguments (``named``)."""

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None = None,
                 tools: ToolParser | None = None):
        self.plan = plan
        self.reasoning = reasoning
        self.tools = tools if plan.mode == "auto" else None
        self.ids: list[str] = []             # the id of each call, in order
        self.num_calls = 0
        self._named_started = False
        self._held = ""                      # required: the JSON array, until it ends

    # -- the tool step ---------------------------------------------------------
    def _calls_of_required(self, text: str) -> list[tuple[str, str]] | None:
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                  for c in calls):
            return None
        return [(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in calls]

    def _id(self, i: int) -> str:
        while len(self.ids) <= i:
            self.ids.append(call_id())
        return self.ids[i]

    def _call(self, i: int, name: str, arguments: str) -> dict:
        self.num_calls = max(self.num_calls, i + 1)
        return {"id": self._id(i), "type": "function", "function": {"name": name, "arguments": arguments}}

    def _tool_message(self, text: str | None) -> tuple[str | None, list[dict]]:
        mode = self.plan.mode
        if mode == "auto" and self.tools is not None:
            try:
                result = self.tools.extract(text or "")
            except Exception:                 # an outside parser that raised: the text as it is
                return text, []
            calls = result.tool_calls if self.plan.parallel else result.tool_calls[:1]
            return result.content, [self._call(i, c.name, c.arguments) for i, c in enumerate(calls)]
        if mode == "required":
            calls = self._calls_of_required(text or "")
            if calls:
                return None, [self._call(i, n, a) for i, (n, a) in enumerate(calls)]
        if mode == "named" and text is not None:
            return None, [self._call(0, self.plan.name, text)]
        return text, []

    def _tool_delta(self, text: str, final: bool) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "auto" and self.tools is not None:
            try:
                d = self.tools.stream(text, final)
            except Exception:
                return text, []
            out = []
            for tc in d.tool_calls:
                if tc.index > 0 and not self.plan.parallel:
                    continue                  # parallel_tool_calls false: the first call only
                piece: dict[str, Any] = {"index": tc.index}
                fn: dict[str, Any] = {}
                if tc.name is not None:
                    piece.update(id=self._id(tc.index), type="function")
                    fn["name"] = tc.name
                    self.num_calls = max(self.num_calls, tc.index + 1)
                fn["arguments"] = tc.arguments
                piece["function"] = fn
                out.append(piece)
            return d.content, out
        if mode == "required":
            self._held += text
            if not final:
                return "", []
            calls = self._calls_of_required(self._held)
            if not calls:
                return self._held, []
            return "", [{"index": i, **self._call(i, n, a)} for i, (n, a) in enumerate(calls)]
        if mode == "named":
            if not text:
                return "", []
            if not self._named_started:
                self._named_started = True
                return "", [{"index": 0, **self._call(0, self.plan.name, text)}]
            return "", [{"index": 0, "function": {"arguments": text}}]
        return text, []

    # -- the whole output, and its pieces --------------------------------------------
    def message(self, text: str) -> dict:
        reasoning, content = None, text
        if self.reasoning is not None:
            try:
                r = self.reasoning.extract(text)
                reasoning, content = r.reasoning, r.content
            except Exception:
                pass
        content, calls = self._tool_message(content)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if self.plan.mode != "none":
            msg["tool_calls"] = calls
        return msg

    def delta(self, text: str, final: bool) -> dict:
        """The delta fields for ``text`` (the choice's new text; ``final``:
        the choice ended): only the fields with something in them."""
        reasoning, content = "", text
        if self.reasoning is not None:
            try:
                r = self.reasoning.stream(text, final)
                reasoning, content = r.reasoning or "", r.content or ""
            except Exception:
                reasoning, content = "", text
        content, calls = self._tool_delta(content, final)
        out: dict[str, Any] = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: ``tool_calls`` when the model stopped having called (auto,
        required); a named call keeps ``stop``, as OpenAI's does."""
        if reason == "stop" and self.num_calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def choice_outputs(plan: ToolPlan, prompt: str, kwargs: dict[str, Any], tokenizer, tool_parser,
                   reasoning_parser, reasoning_max_tokens: int | None = None):
    """Set the sampling fields (``kwargs``, SamplingParams keywords) that
    tools and reasoning need (the guided schema of a required / named call,
    where it starts, the reasoning budget) and return the factory of each
    choice's ChoiceOutput (None: plain content). ``tool_parser`` and
    ``reasoning_parser``: a ``ChatParser`` (``chat_parser``) or None."""
    from fdx.core.sampling_params import SamplingParams
    schema = plan.guided_json()
    if schema is not None:
        given = [k for k in SamplingParams.GUIDED_FIELDS if kwargs.get(k) not in (None, False)]
        if given:
            raise ChatRequestError(f"tool_choice {plan.mode!r} is guaranteed by a guided constraint: a request "
                                   f"cannot also carry {', '.join(given)}", param="tool_choice")
        kwargs["guided_json"] = schema
    reasoning = reasoning_parser
    if reasoning is None:
        if reasoning_max_tokens is not None:
            raise ChatRequestError("reasoning_max_tokens needs a reasoning parser: start the server with "
                                   "--reasoning-parser (server.reasoning_parser)", param="reasoning_max_tokens")
    else:
        probe = reasoning.make(tokenizer)
        if probe.begin(prompt) is not False:       # thinking may come first
            end_ids = tokenizer.encode(probe.end, add_special_tokens=False)
            guided = any(kwargs.get(k) not in (None, False) for k in SamplingParams.GUIDED_FIELDS)
            if guided and probe.reasons_first():
                kwargs["guided_starts_after"] = end_ids     # the constraint holds after the thinking
            # a constraint from the first token leaves no thinking to budget (forcing the end
            # tokens there would fight the grammar)
            if reasoning_max_tokens is not None and (probe.reasons_first() or not guided):
                kwargs["reasoning_max_tokens"] = reasoning_max_tokens
                kwargs["reasoning_end_token_ids"] = end_ids
    if plan.mode == "none" and reasoning is None:
        return None
    tool_cls = tool_parser

    def make() -> ChoiceOutput:
        r = None
        if reasoning is not None:
            r = reasoning.make(tokenizer)
            r.begin(prompt)
        t = tool_cls.make(tokenizer, plan.tools) if plan.mode == "auto" else None
        return ChoiceOutput(plan, r, t)
    return make


class ChatParser:
    """The chat output parser the config selects: its class and validated
    settings, and ``make`` to build one per choice (through the assembly's
    ``make_plugin``, with the tokenizer and the request's tools)."""

    def __init__(self, plugins, config, kind: str, key: str, name: str, cls):
        from fdx.core.config import plugin_settings
        self.plugins, self.config, self.kind, self.key, self.name, self.cls = plugins, config, kind, key, name, cls
        self.settings = plugin_settings(kind, name, cls, (config.plugins.get(kind) or {}).get(name))

    def make(self, tokenizer, tools=None):
        from fdx.core.plugins import make_plugin
        from fdx.core.interfaces import BuildContext
        return make_plugin(BuildContext(self.config, self.plugins, self.kind, self.name, tokenizer=tokenizer,
                                        tools=tools), self.key, self.settings, self.cls)


def chat_parser(plugins, config, kind: str, key: str) -> ChatParser | None:
    """The chat output parser ``server.<key>`` names (kind ``tool_parser``
    or ``reasoning_parser``), or None."""
    from fdx.core.config import ConfigError
    from fdx.core.plugins import PluginError
    name = getattr(config.server, key)
    if name is None:
        return None
    try:
        cls = plugins.get(kind, name)
    except PluginError as e:
        raise ConfigError(f"config key 'server.{key}': {e}") from None
    return ChatParser(plugins, config, kind, f"server.{key}", name, cls)
