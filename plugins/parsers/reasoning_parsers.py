"""The built-in reasoning parsers: ``qwen3``, ``deepseek_r1`` and
``ernie-4.5``, all ``<think>...</think>`` formats that differ in what an
output without tags means.

- ``deepseek_r1``: the template opens the think block (``<think>\\n`` ends
  the prompt), so the output is reasoning up to ``</think>``; a leading
  ``<think>`` is dropped. No ``</think>`` at all: all of it is reasoning.
- ``qwen3``: the model opens the block itself; an output that does not
  start with ``<think>`` (and whose prompt did not open one) is content
  (Qwen3's ``enable_thinking: false`` closes an empty block in the prompt).
- ``ernie-4.5``: as deepseek_r1, and the answer after ``</think>`` may be
  wrapped as ``<response>...</response>`` (ERNIE-4.5's thinking format:
  ``abc\\n</think>\\n\\n<response>\\ndef\\n</response>``); the tags go.

Each reads the text so far with ``split(text, final)``, which keeps back
what may still change (a tail that may begin a tag), so ``stream`` sends
what grew since the last read and its pieces add up to ``extract``'s
result for any split of the output.
"""
from __future__ import annotations

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import ReasoningParser, ReasoningResult


def _hold(text: str, tag: str) -> str:
    """``text`` less a tail that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return text[:-n]
    return text


class ThinkParser(ReasoningParser):

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        self._text = ""
        self._sent = [0, 0]             # reasoning, content characters sent

    def split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) of the text so far."""
        if self.prompt_state is False:
            return "", text
        body = text
        if self.prompt_state is None:
            lead = text.lstrip()
            if lead.startswith(self.start):
                body = lead[len(self.start):]
            elif not final and self.start.startswith(lead):
                return "", ""                         # maybe the opening tag: wait
            elif not self.implicit_reasoning:         # the model did not open a think block: an answer
                return "", text
        k = body.find(self.end)
        if k == -1:
            return (body if final else _hold(body, self.end)), ""
        return body[:k], self.answer(body[k + len(self.end):], final)

    def answer(self, text: str, final: bool) -> str:
        return text

    def extract(self, text: str) -> ReasoningResult:
        try:
            reasoning, content = self.split(text, True)
        except Exception:
            return ReasoningResult(None, text)
        return ReasoningResult(reasoning or None, content or None)

    def stream(self, delta: str, final: bool) -> ReasoningResult:
        self._text += delta
        try:
            reasoning, content = self.split(self._text, final)
        except Exception:
            reasoning, content = ("", self._text) if final else ("", "")
        out = ReasoningResult(reasoning[self._sent[0]:], content[self._sent[1]:])
        self._sent = [max(self._sent[0], len(reasoning)), max(self._sent[1], len(content))]
        return out


class DeepSeekR1ReasoningParser(ThinkParser):
    implicit_reasoning = True


class Qwen3ReasoningParser(ThinkParser):
    implicit_reasoning = False


class Ernie45ReasoningParser(ThinkParser):
    implicit_reasoning = True
    response_start = "<response>"
    response_end = "</response>"

    def answer(self, text: str, final: bool) -> str:
        lead = text.lstrip("\n")
        if lead.startswith(self.response_start):
            inner = lead[len(self.response_start):]
            if inner.startswith("\n"):
                inner = inner[1:]
            k = inner.find(self.response_end)
            if k != -1:
                inner = inner[:k]
                return inner[:-1] if inner.endswith("\n") else inner
            if final:
                return inner
            held = _hold(inner, self.response_end)
            return held[:-1] if held.endswith("\n") else held      # that newline may precede </response>
        if not final and (self.response_start.startswith(lead) or not lead):
            return ""                                 # maybe the opening tag: wait
        return text


BUILTIN_REASONING_PARSERS = {"qwen3": Qwen3ReasoningParser, "deepseek_r1": DeepSeekR1ReasoningParser,
                             "ernie-4.5": Ernie45ReasoningParser,
                             "ernie-x1": Ernie45ReasoningParser}       # FastDeploy's name for it


@hookimpl
def fdx_register_reasoning_parsers(register):
    for name, parser in BUILTIN_REASONING_PARSERS.items():
        register(name, parser)
