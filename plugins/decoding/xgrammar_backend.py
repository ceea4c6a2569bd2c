"""The ``xgrammar`` guided backend (the design card's reference): JSON
schemas, any JSON object, regexes, choices, GBNF-style EBNF grammars and
structural tags. xgrammar imports torch and transformers, so it is
imported only when this backend is built (``decoding.guided_backend:
xgrammar``); its tokenizer info comes from fdx's own tokenizer.

Settings (``plugins.guided_backend.xgrammar``): ``max_threads`` (xgrammar's
compiler threads, default 1), plus the service's ``compile_threads`` and
``cache_size`` (core/guided.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import GUIDED_KINDS, GuidedBackend, GuidedMatcher, GuidedSettings


def vocab_of(tokenizer) -> tuple[list[str], str, bool]:
    """(token strings by id, "byte_level" | "byte_fallback" | "raw",
    add_prefix_space) read from a ``tokenizers.Tokenizer``'s JSON."""
    backend = tokenizer.backend
    vocab = backend.get_vocab(with_added_tokens=True)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    spec = json.loads(backend.to_str())
    decoders = [spec.get("decoder") or {}]
    if decoders[0].get("type") == "Sequence":
        decoders = decoders[0].get("decoders") or []
    types = {d.get("type") for d in decoders}
    model = spec.get("model") or {}
    pre = json.dumps(spec.get("pre_tokenizer") or {}) + json.dumps(spec.get("normalizer") or {})
    if "ByteLevel" in types:
        return tokens, "byte_level", False
    if model.get("byte_fallback") or "ByteFallback" in types:
        return tokens, "byte_fallback", "Prepend" in pre or '"prepend_scheme": "always"' in pre
    return tokens, "raw", False


class XGrammarMatcher(GuidedMatcher):
    __slots__ = ("m",)

    def __init__(self, matcher):
        self.m = matcher

    def fill_bitmask(self, bitmask, row):
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id):
        return self.m.accept_token(token_id)

    def rollback(self, num_tokens):
        self.m.rollback(num_tokens)

    def is_terminated(self):
        return self.m.is_terminated()


@dataclass
class XGrammarSettings(GuidedSettings):
    """``plugins.guided_backend.xgrammar``."""
    max_threads: int = 1                # xgrammar's GrammarCompiler threads


class XGrammarBackend(GuidedBackend):
    requires = ("xgrammar",)
    Settings = XGrammarSettings
    kinds = GUIDED_KINDS

    def __init__(self, settings=None, context=None):
        super().__init__(settings, context)
        tokenizer, vocab_size, eos_token_ids = self.tokenizer, self.vocab_size, context.eos_token_ids
        import xgrammar as xgr
        self.xgr = xgr
        tokens, kind, prefix_space = vocab_of(tokenizer)
        vocab_type = {"byte_level": xgr.VocabType.BYTE_LEVEL, "byte_fallback": xgr.VocabType.BYTE_FALLBACK,
                      "raw": xgr.VocabType.RAW}[kind]
        self.info = xgr.TokenizerInfo(tokens, vocab_type=vocab_type, vocab_size=max(vocab_size, len(tokens)),
                                      stop_token_ids=self.eos_token_ids, add_prefix_space=prefix_space)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=self.settings.max_threads)

    def compile(self, kind, spec, whitespace_flexible=False):
        c = self.compiler
        ws = {"any_whitespace": True} if whitespace_flexible else {"any_whitespace": False,
                                                                   "separators": (",", ":")}
        if kind == "json":
            return c.compile_json_schema(spec, **ws)
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}', **ws)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(spec)))
        if kind == "grammar":
            return c.compile_grammar(spec)
        if kind == "structural_tag":
            tag = json.loads(spec)
            try:
                items = [self.xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in tag["structures"]]
                triggers = list(tag["triggers"])
            except (KeyError, TypeError) as e:
                raise ValueError('a structural tag is {"structures": [{"begin", "schema", "end"}, ...], '
                                 f'"triggers": [...]}}; missing or wrong: {e}') from None
            return c.compile_structural_tag(items, triggers)
        raise ValueError(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled):
        return XGrammarMatcher(self.xgr.GrammarMatcher(compiled))


@hookimpl
def fdx_register_guided_backends(register):
    register("xgrammar", XGrammarBackend)
