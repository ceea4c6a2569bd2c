"""Tokenizer, chat template and incremental detokenizer.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a Hugging Face
directory (tokenizer.json + tokenizer_config.json) or from a GGUF file's
metadata (vocabulary, merges, special tokens, chat template). Chat
templates render with jinja2 the way transformers renders them.
`IncrementalDetokenizer` turns a stream of token ids into text deltas.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

# llama.cpp token types (tokenizer.ggml.token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Split regexes of the byte-level BPE vocabularies (as in their tokenizer.json).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GPT2_PRES = {None, "", "default", "gpt2", "gpt-2"}


class ChatTemplateError(ValueError):
    """A chat template is missing, or a template called `raise_exception`."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and chat templates of a model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        """`add_bos_token`/`add_eos_token`: both None keep the backend's
        post-processor; otherwise it is replaced by one that adds exactly what
        the flags say."""
        self._backend = backend
        self._special_tokens = {
            "bos_token": bos_token,
            "eos_token": eos_token,
            "unk_token": unk_token,
            "pad_token": pad_token,
        }
        self._ensure_special_tokens_exist()
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self._extra_eos_token_ids = {int(i) for i in extra_eos_token_ids}
        self._chat_templates = dict(chat_templates or {})

    # ----- construction -----------------------------------------------------

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja and
        generation_config.json (extra eos ids) from a Hugging Face directory."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config_file = path / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        specials = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES}
        # tokenizer.json's post-processor decides BOS/EOS (as in transformers 5);
        # the tokenizer_config flags apply only when it has none.
        has_post = backend.post_processor is not None
        return cls(
            backend,
            **specials,
            add_bos_token=None if has_post else config.get("add_bos_token"),
            add_eos_token=None if has_post else config.get("add_eos_token"),
            extra_eos_token_ids=_generation_eos_ids(path),
            chat_templates=_hf_chat_templates(path, config),
        )

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Build the tokenizer a GGUF file describes in its `tokenizer.*` metadata.

        Accepts a `gguf.GGUFReader` (to share one already parsed) or a path.
        """
        meta = _GgufTokenizerMeta.read(reader_or_path)
        if meta.model == "gpt2":
            backend = _byte_level_bpe(meta)
        elif meta.model == "llama":
            backend = _sentencepiece_bpe(meta)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {meta.model!r} "
                "(tokenizer.ggml.model); supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece BPE)"
            )
        _add_gguf_added_tokens(backend, meta)
        add_bos = meta.add_bos_token
        if add_bos is None:
            # llama.cpp adds BOS to sentencepiece vocabularies that do not say otherwise.
            add_bos = meta.model == "llama"
        return cls(
            backend,
            bos_token=meta.token(meta.bos_id),
            eos_token=meta.token(meta.eos_id),
            unk_token=meta.token(meta.unk_id),
            pad_token=meta.token(meta.pad_id),
            add_bos_token=add_bos,
            add_eos_token=bool(meta.add_eos_token),
            extra_eos_token_ids=meta.extra_eos_ids,
            chat_templates=meta.chat_templates,
        )

    def _ensure_special_tokens_exist(self) -> None:
        # Like transformers: a named special token missing from the vocabulary is added.
        missing = [
            AddedToken(tok, special=True, normalized=False)
            for tok in self._special_tokens.values()
            if tok is not None and self._backend.token_to_id(tok) is None
        ]
        if missing:
            self._backend.add_special_tokens(missing)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        """Replace the post-processor with one that adds exactly BOS and/or EOS."""
        bos, eos = self._special_tokens["bos_token"], self._special_tokens["eos_token"]
        add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
        head = f"{bos}:0 " if add_bos else ""
        tail = f" {eos}:0" if add_eos else ""
        pair_b = f"{bos}:1 " if add_bos else ""
        pair_e = f" {eos}:1" if add_eos else ""
        special = [(t, self._backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        self._backend.post_processor = processors.TemplateProcessing(
            single=f"{head}$A:0{tail}",
            pair=f"{head}$A:0{tail} {pair_b}$B:1{pair_e}",
            special_tokens=special,
        )

    @property
    def add_bos_token(self) -> bool:
        """Whether encode(..., add_special_tokens=True) starts with BOS."""
        ids = self._backend.encode("", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    @property
    def add_eos_token(self) -> bool:
        """Whether encode(..., add_special_tokens=True) ends with EOS."""
        ids = self._backend.encode("", add_special_tokens=True).ids
        return bool(ids) and ids[-1] == self._id_of("eos_token")

    # ----- encode / decode --------------------------------------------------

    @property
    def backend(self) -> BackendTokenizer:
        """The wrapped `tokenizers.Tokenizer`."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token text (e.g. "<|im_start|>") maps to its id.
        `add_special_tokens` adds BOS/EOS as the tokenizer's config says."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._backend.token_to_id(tokens)
        return [self._backend.token_to_id(t) for t in tokens]

    def detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """An incremental detokenizer over this tokenizer: what the output
        processor (core/output.py) turns one sequence's token stream into
        text with (it imports no tokenizer module)."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def __len__(self) -> int:
        return self.vocab_size

    # ----- special tokens ---------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def _id_of(self, name: str) -> int | None:
        token = self._special_tokens[name]
        return None if token is None else self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens["bos_token"]

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens["eos_token"]

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens["pad_token"]

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens["unk_token"]

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The primary end-of-sequence id (see `eos_token_ids` for all of them)."""
        eos = self._id_of("eos_token")
        if eos is None and self._extra_eos_token_ids:
            return min(self._extra_eos_token_ids)
        return eos

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: eos_token plus generation_config's eos ids."""
        eos = self._id_of("eos_token")
        return self._extra_eos_token_ids | ({eos} if eos is not None else set())

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._id_of("unk_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: tok for name, tok in self._special_tokens.items() if tok is not None}

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the named special tokens and every added token marked special."""
        ids = {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        ids |= {i for name in _SPECIAL_NAMES if (i := self._id_of(name)) is not None}
        return sorted(ids)

    # ----- chat template ----------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template, or None if the model has none."""
        return self._chat_templates.get("default")

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` (``model.chat_template``: a file's path, or the
        template text itself) as the default chat template, in place of the
        model's own."""
        self._chat_templates["default"] = chat_template_text(source)

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates ("default", and e.g. "tool_use")."""
        return dict(self._chat_templates)

    def _select_template(self, chat_template: str | None, tools: list | None) -> str:
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if self._chat_templates:
            raise ChatTemplateError(
                f"this model has several chat templates {sorted(self._chat_templates)} "
                "and none named 'default': pass chat_template=<name>"
            )
        raise ChatTemplateError(
            "this model has no chat template (none in tokenizer_config.json, chat_template.jinja "
            "or the GGUF metadata); pass chat_template= or use plain completions"
        )

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        documents: list[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the chat template, as transformers'
        `apply_chat_template(..., tokenize=False)` does.

        `chat_template` is a template name or the template text itself; extra
        keyword arguments become template variables (e.g. enable_thinking).
        """
        import jinja2                       # here, not at import: the engine process never renders a chat
        source = self._select_template(chat_template, tools)
        variables = {**self.special_tokens_map, **_plain(kwargs)}
        try:
            return _compile_template(source).render(
                messages=_plain(list(messages)),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:  # syntax errors, undefined values, sandbox refusals
            raise ChatTemplateError(f"chat template failed: {e}") from e


# ----- Hugging Face directory helpers -------------------------------------


def chat_template_text(source: str) -> str:
    """A ``--chat-template`` value as vLLM reads it: a file's contents when it
    names a file, else the template itself if it holds Jinja (``{{`` or ``{%``)."""
    path = Path(source).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"config key 'model.chat_template': cannot read {source}: {e}") from None
    if "{{" in source or "{%" in source:
        return source
    raise ValueError(f"config key 'model.chat_template': {source!r} is neither a file nor a Jinja template "
                     "(no '{{' or '{%' in it)")


def _hf_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Templates from tokenizer_config.json (a string or a list of
    {"name", "template"}), then chat_template.jinja / chat_template.json."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates.update({item["name"]: item["template"] for item in raw})
    jinja_file = path / "chat_template.jinja"
    json_file = path / "chat_template.json"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    elif json_file.is_file() and isinstance(t := _read_json(json_file).get("chat_template"), str):
        templates.setdefault("default", t)
    templates_dir = path / "additional_chat_templates"
    if templates_dir.is_dir():
        for f in sorted(templates_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    return templates


def _generation_eos_ids(path: Path) -> list[int]:
    gen_file = path / "generation_config.json"
    if not gen_file.is_file():
        return []
    eos = _read_json(gen_file).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


# ----- GGUF helpers -----------------------------------------------------


class _GgufTokenizerMeta:
    """The `tokenizer.*` metadata of a GGUF file as plain Python values."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        def get(key: str, default: Any = None) -> Any:
            return fields.get(f"tokenizer.{key}", default)

        if get("ggml.tokens") is None:
            raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        self.model: str | None = get("ggml.model")
        self.pre: str | None = get("ggml.pre")
        self.tokens: list[str] = list(get("ggml.tokens"))
        self.token_types: list[int] = list(get("ggml.token_type") or [_NORMAL] * len(self.tokens))
        self.scores: list[float] | None = get("ggml.scores")
        self.merges: list[str] | None = get("ggml.merges")
        self.bos_id: int | None = get("ggml.bos_token_id")
        self.eos_id: int | None = get("ggml.eos_token_id")
        self.unk_id: int | None = get("ggml.unknown_token_id")
        self.pad_id: int | None = get("ggml.padding_token_id")
        self.extra_eos_ids: list[int] = [
            i for key in ("ggml.eot_token_id", "ggml.eom_token_id") if (i := get(key)) is not None
        ]
        self.add_bos_token: bool | None = get("ggml.add_bos_token")
        self.add_eos_token: bool | None = get("ggml.add_eos_token")
        self.add_space_prefix: bool | None = get("ggml.add_space_prefix")
        self.chat_templates = _gguf_chat_templates(fields)

    @classmethod
    def read(cls, reader_or_path: Any) -> _GgufTokenizerMeta:
        import gguf

        reader = reader_or_path
        if not isinstance(reader, gguf.GGUFReader):
            path = Path(reader_or_path)
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            from fdx.model_io.gguf_file import read_gguf
            reader = read_gguf(path)
        fields = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
        return cls(fields)

    def token(self, token_id: int | None) -> str | None:
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def is_added(self, token_id: int) -> bool:
        return self.token_types[token_id] in (_CONTROL, _USER_DEFINED)


def _gguf_chat_templates(fields: Mapping[str, Any]) -> dict[str, str]:
    templates = {}
    if isinstance(t := fields.get("tokenizer.chat_template"), str):
        templates["default"] = t
    for name in fields.get("tokenizer.chat_templates") or []:
        if isinstance(t := fields.get(f"tokenizer.chat_template.{name}"), str):
            templates[name] = t
    return templates


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level vocabulary, by llama.cpp's `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # HF SmolLM tokenizer.json: digits one by one, then GPT-2's split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _SPLIT_BY_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_PRES:
        logger.warning("unknown GGUF pre-tokenizer %r: using GPT-2's split", pre)
    return byte_level


def _byte_level_bpe(meta: _GgufTokenizerMeta) -> BackendTokenizer:
    """Byte-level BPE ("gpt2") from the GGUF vocabulary and merges."""
    if meta.merges is None:
        logger.warning("GGUF byte-level tokenizer has no tokenizer.ggml.merges: tokens stay unmerged")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(i: int, token: str) -> str:
        # Added tokens stay as written; a normal token must be in the byte alphabet.
        if meta.is_added(i) or set(token) <= alphabet:
            return token
        return "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(i, t): i for i, t in enumerate(meta.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.merges or []]
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Sentencepiece BPE merges implied by the vocabulary and its scores
    (the same rule as transformers' `generate_merges`)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [
            (token[:k], token[k:], score)
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(meta: _GgufTokenizerMeta) -> BackendTokenizer:
    """Sentencepiece BPE ("llama") with byte fallback, like transformers' LlamaTokenizer."""
    if meta.merges is not None:
        merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    elif meta.scores is not None:
        merges = _score_merges(meta.tokens, list(meta.scores))
    else:
        raise ValueError("GGUF sentencepiece (llama) tokenizer has neither merges nor scores")
    vocab = {t: i for i, t in enumerate(meta.tokens)}
    unk = meta.token(meta.unk_id)
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = meta.add_space_prefix is not False
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _add_gguf_added_tokens(backend: BackendTokenizer, meta: _GgufTokenizerMeta) -> None:
    """Control tokens become special tokens, user-defined ones plain added
    tokens: both are matched whole in the text, with their own ids."""
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, kind in zip(meta.tokens, meta.token_types)
        if kind == _CONTROL
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, kind in zip(meta.tokens, meta.token_types)
        if kind == _USER_DEFINED
    ]
    if control:
        backend.add_special_tokens(control)
    if user:
        backend.add_tokens(user)


# ----- chat template rendering ------------------------------------------


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: no HTML escaping, unicode kept, optional indent.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:  # noqa: F821 (imported here)
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy made of plain JSON-like types, so templates never touch caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):  # pydantic models
        return _plain(value.model_dump(exclude_none=True))
    for base in (bool, int, float, str):
        if isinstance(value, base):
            return base(value)
    if hasattr(value, "item"):  # numpy scalars
        return _plain(value.item())
    return str(value)


# ----- incremental detokenizer -------------------------------------------


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Each `add` decodes only a short window: the tokens from `prefix_offset`
    (a little context, so decoders that treat the first token specially
    agree) to the end, and returns the part past `read_offset`. Text whose
    tail is an incomplete UTF-8 character (U+FFFD) is held back until the
    next tokens complete it. The deltas concatenate to
    `tokenizer.decode(all_ids)`; call `finish()` at the end of the stream
    to release a tail that never completed.
    """

    _PROMPT_CONTEXT = 6  # prompt tokens kept as decoding context

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids or [])[-self._PROMPT_CONTEXT :]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_context = len(context)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Iterable[int]) -> str:
        """Append `token_ids`; return only the newly completed text."""
        self._ids.extend(int(i) for i in token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing new, or an incomplete character: wait for more
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def finish(self) -> str:
        """Release whatever is held back (a tail that stayed incomplete)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta
