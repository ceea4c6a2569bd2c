"""Third-party chat output parsers, written from docs/plugins.md alone (they
import only ``fdx.core``), for the API process of ``fdx serve``:

- ``example-actions`` tool parser: a line ``ACTION <name> <json arguments>``
  is a call; other lines are content. It implements ``extract`` only, so
  streaming takes the contract's default (the calls come at the end).
- ``example-thoughts`` reasoning parser: ``[[thought]] ... [[/thought]]``
  before the answer; the model thinks first, so a guided constraint
  starts after ``[[/thought]]``.
"""
from __future__ import annotations

import json

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ReasoningParser, ReasoningResult, ToolCall, ToolParser, ToolParseResult


class ActionLines(ToolParser):
    def __init__(self, settings, context):
        super().__init__(settings, context)

    def extract(self, text):
        calls, content = [], []
        for line in text.split("\n"):
            parts = line.split(" ", 2)
            if len(parts) == 3 and parts[0] == "ACTION":
                try:
                    json.loads(parts[2])
                except ValueError:
                    content.append(line)          # not a call after all: plain text
                    continue
                calls.append(ToolCall(parts[1], parts[2]))
            else:
                content.append(line)
        rest = "\n".join(content)
        return ToolParseResult(rest if rest.strip() else None, calls)


class Thoughts(ReasoningParser):
    """The model thinks first (``implicit_reasoning``): up to ``[[/thought]]``
    is reasoning, with or without the opening tag."""
    start = "[[thought]]"
    end = "[[/thought]]"
    implicit_reasoning = True

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def extract(self, text):
        if self.prompt_state is False:
            return ReasoningResult(None, text or None)
        body = text[len(self.start):] if text.startswith(self.start) else text
        if self.end in body:
            reasoning, _, answer = body.partition(self.end)
            return ReasoningResult(reasoning or None, answer or None)
        return ReasoningResult(body or None, None)


@hookimpl
def fdx_register_tool_parsers(register):
    register("example-actions", ActionLines)


@hookimpl
def fdx_register_reasoning_parsers(register):
    register("example-thoughts", Thoughts)
