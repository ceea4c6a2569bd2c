"""The built-in tool-call parsers: ``hermes`` (Qwen2.5 / Qwen3:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), ``ernie-4.5``
(the same tags, after ERNIE's ``</think>``), and ``llama3_json`` (Llama 3.x:
``{"name": ..., "parameters": {...}}`` objects, ``;``-separated, maybe after
``<|python_tag|>``).

Each reads its text as segments (plain text, calls) with one function,
``segments(text, final)``; ``final=False`` reads a prefix of the output and
keeps back what may still change: the tail of the text that may begin a
call tag, a call whose name is not read yet, the arguments' trailing
whitespace and closing brace. What it gives for a prefix is a prefix of
what it gives for the whole, so streaming is the difference between two
reads, and the pieces add up to ``extract``'s result for any split.

Rules (both modes): a call whose ``{"name": "...", "arguments": `` head
reads is a call, its arguments the JSON text as written (OpenAI's
arguments string may be invalid JSON; a client validates it); a tagged
block whose head does not read (not JSON, no name) is plain content, tags
and all. Nothing raises.
"""
from __future__ import annotations

import json

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ToolCall, ToolCallDelta, ToolParseDelta, ToolParser, ToolParseResult

_decoder = json.JSONDecoder()
_WS = " \t\n\r"

# a call read from text: (name, arguments text, complete)
Call = tuple[str, str, bool]


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _value(s: str, i: int):
    """(value, end) of the JSON value at ``s[i]``, or None if it does not read."""
    try:
        return _decoder.raw_decode(s, i)
    except ValueError:
        return None


def read_call(s: str, i: int, final: bool, arg_keys=("arguments", "parameters")) -> tuple[Call | None, int | None]:
    """The call object starting at ``s[i]`` (``{``): (call or None, index
    just past the object, or None when it is not complete). None for the
    call: its head (name, then the arguments key) does not read (yet), and
    it is not a whole object with those keys in another order (Hermes-2-Pro
    writes ``{"arguments": ..., "name": ...}``): such an object is a call
    once it is whole, its arguments re-serialized."""
    call, end = _read_head_first(s, i, final, arg_keys)
    if call is not None:
        return call, end
    whole = _value(s, i)
    if whole is not None and isinstance(whole[0], dict) and isinstance(whole[0].get("name"), str):
        args = next((whole[0][k] for k in arg_keys if k in whole[0]), None)
        if args is not None:
            text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
            return (whole[0]["name"], text, True), whole[1]
    return None, None


def _read_head_first(s: str, i: int, final: bool, arg_keys) -> tuple[Call | None, int | None]:
    j = _skip(s, i + 1)
    key = _value(s, j)
    if key is None or key[0] != "name":
        return None, None
    j = _skip(s, key[1])
    if j >= len(s) or s[j] != ":":
        return None, None
    name = _value(s, _skip(s, j + 1))
    if name is None or not isinstance(name[0], str):
        return None, None
    j = _skip(s, name[1])
    if j >= len(s) or s[j] != ",":
        return None, None
    key = _value(s, _skip(s, j + 1))
    if key is None or key[0] not in arg_keys:
        return None, None
    j = _skip(s, key[1])
    if j >= len(s) or s[j] != ":":
        return None, None
    a0 = _skip(s, j + 1)
    if a0 >= len(s):
        return ((name[0], "", False), None) if not final else ((name[0], "", True), len(s))
    args = _value(s, a0) if s[a0] in "{[" else None
    if args is not None:
        k = _skip(s, args[1])
        end = k + 1 if k < len(s) and s[k] == "}" else None
        return (name[0], s[a0:args[1]], True), end
    if s[a0] == '"' and (value := _value(s, a0)) is not None:     # arguments sent as a JSON string
        k = _skip(s, value[1])
        end = k + 1 if k < len(s) and s[k] == "}" else None
        return (name[0], value[0], True), end
    # arguments not (yet) a whole JSON value: everything so far, less a trailing brace (the object's)
    # and whitespace, which may yet turn out to close the call rather than the arguments
    rest = s[a0:].rstrip(_WS)
    if rest.endswith("}"):
        rest = rest[:-1].rstrip(_WS)
    if s[a0] == '"':                    # a string not yet closed: only its whole text is kept
        rest = "" if not final else rest
    return (name[0], rest, final), None


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class SegmentToolParser(ToolParser):
    """Streaming by difference: ``segments`` (subclasses) reads the text
    so far; ``stream`` sends what grew since the last read."""

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._text = ""
        self._sent_content = 0
        self._sent: list[tuple[str, int]] = []      # per call: (name, arguments characters sent)

    def segments(self, text: str, final: bool) -> list[str | Call]:
        raise NotImplementedError

    def extract(self, text: str) -> ToolParseResult:
        try:
            segs = self.segments(text, True)
        except Exception:                     # never a 500: the text as it is
            return ToolParseResult(text if text.strip() else None, [])
        content = "".join(s for s in segs if isinstance(s, str))
        calls = [ToolCall(s[0], s[1]) for s in segs if not isinstance(s, str)]
        return ToolParseResult(content if content.strip() else None, calls)

    def stream(self, delta: str, final: bool) -> ToolParseDelta:
        self._text += delta
        try:
            segs = self.segments(self._text, final)
        except Exception:
            segs = [self._text] if final else []
        content = "".join(s for s in segs if isinstance(s, str))
        calls = [s for s in segs if not isinstance(s, str)]
        out = ToolParseDelta(content[self._sent_content:])
        self._sent_content = max(self._sent_content, len(content))
        for i, (name, args, _complete) in enumerate(calls):
            if i == len(self._sent):
                self._sent.append((name, 0))
                out.tool_calls.append(ToolCallDelta(i, name, ""))
            sent_name, n = self._sent[i]
            if len(args) > n:
                if out.tool_calls and out.tool_calls[-1].index == i:
                    out.tool_calls[-1].arguments += args[n:]
                else:
                    out.tool_calls.append(ToolCallDelta(i, None, args[n:]))
                self._sent[i] = (sent_name, len(args))
        return out


class TaggedToolParser(SegmentToolParser):
    """Calls as JSON objects between two tags."""
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        segs: list[str | Call] = []
        pos = 0
        while True:
            k = text.find(self.start_tag, pos)
            if k == -1:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - _partial_prefix(tail, self.start_tag)]
                segs.append(tail)
                return segs
            segs.append(text[pos:k])
            body = k + len(self.start_tag)
            e = text.find(self.end_tag, body)
            closed = e != -1
            inner = text[body:e] if closed else text[body:]
            if not closed and not final:
                inner = inner[:len(inner) - _partial_prefix(inner, self.end_tag)]
            i = _skip(inner, 0)
            call = read_call(inner, i, final or closed)[0] if i < len(inner) and inner[i] == "{" else None
            if call is not None:
                segs.append(call)
            elif closed or final:              # not a call: the block is content, tags and all
                segs.append(text[k:e + len(self.end_tag)] if closed else text[k:])
            if not closed:
                return segs
            pos = e + len(self.end_tag)


class HermesToolParser(TaggedToolParser):
    """Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``."""


class Ernie45ToolParser(TaggedToolParser):
    """ERNIE-4.5 (FastDeploy's ernie tool format): the same ``<tool_call>``
    blocks of ``{"name", "arguments"}`` JSON, which the model writes after
    its ``</think>``; run with the ``ernie-4.5`` reasoning parser, which
    takes the thinking (and a ``<response>`` wrapper) away first."""


class Llama3JsonToolParser(SegmentToolParser):
    """Llama 3.1/3.2 JSON tool calls: an output that starts (after
    whitespace and an optional ``<|python_tag|>``) with ``{`` is one or more
    ``{"name": ..., "parameters": {...}}`` objects separated by ``;``; any
    other output is content. Text after the last call is content."""
    python_tag = "<|python_tag|>"

    def segments(self, text: str, final: bool) -> list[str | Call]:
        i = _skip(text, 0)
        if text.startswith(self.python_tag, i):
            i = _skip(text, i + len(self.python_tag))
        elif not final and self.python_tag.startswith(text[i:]):
            return []                         # maybe the tag: wait
        if i >= len(text):
            return [text] if final else []
        if text[i] != "{":
            return [text]
        segs: list[str | Call] = []
        while True:
            call, end = read_call(text, i, final)
            if call is None:
                if final or _value(text, i) is not None:     # a whole object that is not a call
                    segs.append(text[i:])
                return segs
            segs.append(call)
            if end is None:
                return segs
            j = _skip(text, end)
            if j < len(text) and text[j] == ";":
                j = _skip(text, j + 1)
                if j < len(text) and text[j] == "{":
                    i = j
                    continue
                if j >= len(text) and not final:
                    return segs
            if j < len(text) or final:
                segs.append(text[end:])
            return segs


BUILTIN_TOOL_PARSERS = {"hermes": HermesToolParser, "ernie-4.5": Ernie45ToolParser,
                        "ernie-x1": Ernie45ToolParser,      # FastDeploy's name for ERNIE-4.5-21B-A3B-Thinking's
                        "llama3_json": Llama3JsonToolParser}


@hookimpl
def fdx_register_tool_parsers(register):
    for name, parser in BUILTIN_TOOL_PARSERS.items():
        register(name, parser)
