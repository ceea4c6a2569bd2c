"""The ``llguidance`` guided backend: JSON schemas, any JSON object,
regexes, choices and GBNF-style grammars (converted to Lark with
llguidance's own converter). No heavy dependencies: serving with it needs
no torch. Its tokenizer is built from the tokenizer.json text of fdx's own
tokenizer.

Settings (``plugins.guided_backend.llguidance``): ``log_level`` (0-2,
default 0), plus the service's ``compile_threads`` and ``cache_size``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import GuidedBackend, GuidedMatcher, GuidedSettings


class LLGuidanceMatcher(GuidedMatcher):
    __slots__ = ("m", "fill", "counted")

    def __init__(self, matcher, fill):
        self.m = matcher
        self.fill = fill
        self.counted: list[bool] = []   # per accepted token: did llguidance count it (an eos
                                        # accepted once stopped is not a token to roll back)

    def fill_bitmask(self, bitmask, row):
        self.fill(self.m, bitmask, row)

    def accept_token(self, token_id):
        was_stopped = self.m.is_stopped()
        if not self.m.consume_token(token_id):
            return False
        self.counted.append(not was_stopped)
        return True

    def rollback(self, num_tokens):
        real = sum(self.counted[-num_tokens:]) if num_tokens else 0
        del self.counted[len(self.counted) - num_tokens:]
        if real and not self.m.rollback(real):
            raise ValueError(f"llguidance could not roll back {real} tokens: {self.m.get_error()}")

    def is_terminated(self):
        return self.m.is_stopped()

    def validate_tokens(self, token_ids):
        # llguidance's own check: a token consume_token refuses leaves the matcher in error
        return self.m.validate_tokens([int(t) for t in token_ids])


@dataclass
class LLGuidanceSettings(GuidedSettings):
    """``plugins.guided_backend.llguidance``."""
    log_level: int = 0                  # llguidance's own log verbosity (0: quiet)


class LLGuidanceBackend(GuidedBackend):
    requires = ("llguidance",)
    Settings = LLGuidanceSettings
    kinds = ("json", "json_object", "regex", "choice", "grammar")

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        tokenizer, vocab_size, eos_token_ids = self.tokenizer, self.vocab_size, context.eos_token_ids
        import llguidance
        import llguidance.numpy as llnp
        from llguidance.gbnf_to_lark import gbnf_to_lark
        self.llg, self.gbnf_to_lark = llguidance, gbnf_to_lark
        import numpy
        self.fill, self.np = llnp.fill_next_token_bitmask, numpy
        self.log_level = self.settings.log_level
        self.lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                            eos_token=self.eos_token_ids or None)

    def compile(self, kind, spec, whitespace_flexible=False):
        M = self.llg.LLMatcher
        ws = ({"whitespace_flexible": True} if whitespace_flexible else
              {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        if kind == "json":
            grammar = M.grammar_from_json_schema(spec, overrides=ws)
        elif kind == "json_object":
            grammar = M.grammar_from_json_schema('{"type": "object"}', overrides=ws)
        elif kind == "regex":
            grammar = M.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = M.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in json.loads(spec)))
        elif kind == "grammar":
            try:
                grammar = M.grammar_from_lark(self.gbnf_to_lark(spec))
            except Exception as e:
                raise ValueError(f"not a valid GBNF grammar: {e}") from None
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
        error = M.validate_grammar(grammar, self.lltok)
        if error and not error.startswith("WARNING"):
            raise ValueError(error.strip())
        # build a matcher here, off the step loop, and compute its first mask (llguidance does
        # most of its work then); requests get copies of it (deep_copy: microseconds)
        template = M(self.lltok, grammar, log_level=self.log_level)
        if template.is_error():
            raise ValueError(template.get_error())
        self.fill(template, self.np.zeros((1, (self.vocab_size + 31) // 32), dtype=self.np.int32), 0)
        return template

    def matcher(self, compiled):
        return LLGuidanceMatcher(compiled.deep_copy(), self.fill)


@hookimpl
def fdx_register_guided_backends(register):
    register("llguidance", LLGuidanceBackend)
