"""A third-party guided backend: choices only, matched over token ids.

It proves the guided contract from outside fdx (it imports only
``fdx.core``): each choice is tokenized as written, and the mask allows
the next token of every choice the output is still a prefix of, and the
eos ids once the output is a whole choice.
"""
from __future__ import annotations

import json

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import GuidedBackend, GuidedMatcher


class ChoiceMatcher(GuidedMatcher):
    def __init__(self, seqs: list[tuple[int, ...]], eos: list[int]):
        self.seqs, self.eos = seqs, eos
        self.out: list[int] = []
        self.ended = False

    def _allowed(self) -> set[int]:
        if self.ended:
            return set(self.eos)
        n, prefix = len(self.out), tuple(self.out)
        allowed = {s[n] for s in self.seqs if len(s) > n and s[:n] == prefix}
        if prefix in self.seqs:
            allowed.update(self.eos)
        return allowed

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self._allowed():
            word = bitmask[row, t // 32].item() & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word

    def accept_token(self, token_id):
        if token_id not in self._allowed():
            return False
        if token_id in self.eos:
            self.ended = True
        else:
            self.out.append(token_id)
        return True

    def rollback(self, num_tokens):
        for _ in range(num_tokens):
            if self.ended:
                self.ended = False
            else:
                self.out.pop()

    def is_terminated(self):
        return self.ended


class ChoiceBackend(GuidedBackend):
    kinds = ("choice",)

    def __init__(self, settings, context):
        super().__init__(settings, context)

    def compile(self, kind, spec, whitespace_flexible=False):
        if kind != "choice":
            raise ValueError(f"example_choice compiles choices only, not {kind}")
        return [tuple(self.tokenizer.encode(c, add_special_tokens=False)) for c in json.loads(spec)]

    def matcher(self, compiled):
        return ChoiceMatcher(compiled, self.eos_token_ids)


@hookimpl
def fdx_register_guided_backends(register):
    register("example_choice", ChoiceBackend)
