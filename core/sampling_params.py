"""Per-request sampling parameters (the user-facing knobs, validated once)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """vLLM's structured-output request (``SamplingParams(structured_outputs=...)``,
    the body field ``structured_outputs``): one constraint, which fdx turns into
    the ``guided_*`` field of the same meaning. ``disable_any_whitespace``
    keeps JSON compact, as in vLLM (there, and so here, any whitespace is
    allowed by default; fdx's own ``guided_json`` is compact by default)."""
    json: dict | str | None = None          # a JSON schema -> guided_json
    regex: str | None = None                # -> guided_regex
    choice: list[str] | None = None         # -> guided_choice
    grammar: str | None = None              # -> guided_grammar
    json_object: bool | None = None         # -> guided_json_object
    structural_tag: dict | str | None = None   # -> structural_tag
    disable_any_whitespace: bool = False    # True: compact JSON (guided_whitespace_flexible False)

    def guided_fields(self) -> dict[str, Any]:
        out = {name: value for name, value in (
            ("guided_json", self.json), ("guided_regex", self.regex), ("guided_choice", self.choice),
            ("guided_grammar", self.grammar), ("guided_json_object", self.json_object or None),
            ("structural_tag", self.structural_tag)) if value is not None}
        if len(out) > 1:
            raise ValueError("invalid sampling parameter structured_outputs=...: it takes one of json, regex, "
                             f"choice, grammar, json_object, structural_tag, not {len(out)}")
        if out and not self.disable_any_whitespace:
            out["guided_whitespace_flexible"] = True
        return out


GuidedDecodingParams = StructuredOutputsParams     # FastDeploy's (and vLLM < 0.12's) name for it


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                              # completions per prompt
    temperature: float = 1.0                # 0 means greedy
    top_p: float = 1.0                      # nucleus mass, in (0, 1]
    top_k: int = -1                         # -1 (or 0) disables
    min_p: float = 0.0                      # drop tokens below min_p * p_max
    seed: int | None = None                 # per-request RNG seed
    presence_penalty: float = 0.0           # OpenAI-style, on generated tokens
    frequency_penalty: float = 0.0          # OpenAI-style, on generated tokens
    repetition_penalty: float = 1.0         # HF/CTRL-style, prompt + generated
    max_tokens: int | None = 16             # None: up to max_model_len
    min_tokens: int = 0                     # no stop (eos/stop ids/strings) before this
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None             # top-N logprobs per sampled token (0: only the sampled)
    skip_special_tokens: bool = True
    detokenize: bool = True                 # False: token ids only, the output processor makes no
                                            # text (core/output.py); stop strings need it True
    prompt_logprobs: int | None = None      # top-N logprobs of each prompt token (0: only the token)
    logit_bias: dict[int, float] | None = None     # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None     # only these may be sampled
    bad_words: list[str] | None = None      # never generate these words (their last token is banned
                                            # where the tokens before it were just generated)
    bad_words_token_ids: list[list[int]] | None = None  # bad_words already tokenized (bad_word_sequences):
                                            # the server does it in its API process, not on the engine thread
    extra_args: dict[str, Any] | None = None       # per-request arguments for logits-processor plugins
    # guided decoding (decoding.guided_backend; at most one constraint per request; see docs/guided.md)
    guided_json: dict | str | None = None   # a JSON schema (a dict, or its JSON text)
    guided_json_object: bool = False        # any JSON object
    guided_regex: str | None = None         # the whole output matches this regex
    guided_choice: list[str] | None = None  # the output is one of these strings
    guided_grammar: str | None = None       # a GBNF-style EBNF grammar (its start rule is `root`)
    structural_tag: dict | str | None = None   # tagged segments in free text (xgrammar)
    guided_whitespace_flexible: bool = False   # JSON may hold any whitespace (default: compact)
    guided_starts_after: list[int] | None = None   # the constraint applies only after the output holds
                                            # these tokens (the end of a think block); free text before
    # reasoning budget (a reasoning parser's think block): past this many output tokens with no
    # reasoning_end_token_ids among them, those tokens are forced (FastDeploy's reasoning_max_tokens)
    reasoning_max_tokens: int | None = None
    reasoning_end_token_ids: list[int] | None = None
    # activation hooks (docs/research.md): capture and/or add to this request's activations at named
    # points, {"capture": [{"point", "layer", "positions"}], "add": [{..., "vector"|"function"}]}
    activations: dict | None = None
    # vLLM's name for a constraint (StructuredOutputsParams or its dict): turned into the guided_*
    # field above at construction, and None after it
    structured_outputs: Any = None         # StructuredOutputsParams | dict | None (Any: msgspec encodes the class)

    def __post_init__(self) -> None:
        if self.structured_outputs is not None:
            self._take_structured_outputs()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.activations is not None:        # plain lists (numpy vectors in process): it crosses msgpack
            from fdx.core.activations import to_plain
            self.activations = to_plain(self.activations)
        if isinstance(self.logit_bias, dict):   # OpenAI sends token ids as JSON object keys (strings)
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("invalid sampling parameter logit_bias: keys must be token ids") from None
        self.validate()

    def _take_structured_outputs(self) -> None:
        so, self.structured_outputs = self.structured_outputs, None
        if isinstance(so, dict):
            known = {f.name for f in fields(StructuredOutputsParams)}
            unknown = sorted(set(so) - known)
            if unknown:
                raise ValueError(f"invalid sampling parameter structured_outputs={{{unknown[0]!r}: ...}}: unknown "
                                 f"key {unknown[0]!r}; known: {', '.join(sorted(known))}")
            so = StructuredOutputsParams(**so)
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError("invalid sampling parameter structured_outputs=...: a StructuredOutputsParams or a dict")
        taken = so.guided_fields()
        already = [f.name for f in fields(self) if f.name.startswith(("guided_", "structural_tag"))
                   and f.name not in ("guided_whitespace_flexible", "guided_starts_after")
                   and getattr(self, f.name) not in (None, False)]
        if taken and already:
            raise ValueError(f"invalid sampling parameter structured_outputs=...: {already[0]} is set too; a "
                             "request takes at most one guided decoding constraint")
        for name, value in taken.items():
            setattr(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as a shallow dict (no deep copy, unlike dataclasses.asdict:
        copying a long token-id list took 160 ms of the event loop)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    def validate(self) -> None:
        def bad(name: str, why: str):
            shown = repr(getattr(self, name))
            shown = shown if len(shown) <= 80 else shown[:60] + f"... ({len(shown)} characters)"
            raise ValueError(f"invalid sampling parameter {name}={shown}: {why}")

        # hostile-input bounds (issue 13): real finite numbers, 64-bit integers, bounded lists
        import math
        import numbers
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
                bad(name, "must be a finite number")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs"):
            v = getattr(self, name)
            if isinstance(v, int) and not -2**63 <= v < 2**63:
                bad(name, "is out of the 64-bit integer range")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63)")
        if not isinstance(self.top_k, int) or self.top_k >= 2**31:
            bad("top_k", "must be an integer below 2**31")
        if len(self.stop) > 128 or any(isinstance(s, str) and len(s) > 4096 for s in self.stop):
            bad("stop", "at most 128 stop strings of at most 4096 characters each")
        if len(self.stop_token_ids) > 1024 or any(isinstance(t, int) and t >= 2**31 for t in self.stop_token_ids):
            bad("stop_token_ids", "at most 1024 token ids, each below 2**31")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an integer >= 1")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (disabled), 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must not exceed max_tokens")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.stop and not self.detokenize:
            bad("stop", "stop strings need detokenize=True")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    isinstance(t, bool) or not isinstance(t, int) or t < 0
                    or isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                    or not -100 <= b <= 100 for t, b in self.logit_bias.items()):
                bad("logit_bias", "must map non-negative token ids to numbers in [-100, 100]")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w for w in self.bad_words)):
            bad("bad_words", "must be a list of non-empty strings")
        if self.bad_words_token_ids is not None and (
                not isinstance(self.bad_words_token_ids, list)
                or any(not isinstance(seq, list) or not seq or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31 for t in seq)
                    for seq in self.bad_words_token_ids)):
            bad("bad_words_token_ids", "must be a list of non-empty lists of token ids")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            bad("extra_args", "must be a JSON object (a dict)")
        self._validate_guided(bad)
        if self.activations is not None:
            from fdx.core.activations import parse
            parse(self.activations)
        for name in ("guided_starts_after", "reasoning_end_token_ids"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, list) or not value or any(
                    isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31 for t in value)):
                bad(name, "must be a non-empty list of token ids")
        if self.reasoning_max_tokens is not None and (
                isinstance(self.reasoning_max_tokens, bool) or not isinstance(self.reasoning_max_tokens, int)
                or not 0 <= self.reasoning_max_tokens < 2**31):
            bad("reasoning_max_tokens", "must be an integer >= 0")

    GUIDED_FIELDS = ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar",
                     "structural_tag")

    def _validate_guided(self, bad) -> None:
        for name in ("guided_json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    bad(name, f"is not valid JSON: {e}")
            if value is not None and not isinstance(value, dict):
                bad(name, "must be a JSON object (a dict or its JSON text)")
        for name in ("guided_regex", "guided_grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, "must be a non-empty string")
        if self.guided_choice is not None and (
                not isinstance(self.guided_choice, list) or not self.guided_choice
                or any(not isinstance(c, str) or not c for c in self.guided_choice)):
            bad("guided_choice", "must be a non-empty list of non-empty strings")
        for name in ("guided_json_object", "guided_whitespace_flexible"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false")
        given = [n for n in self.GUIDED_FIELDS if getattr(self, n) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"invalid sampling parameters {', '.join(given)}: a request takes at most one "
                             "guided decoding constraint")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


# what a pooling request (model.task embed) runs with: its prompt's prefill and one (unused) token,
# after which the scheduler finishes it ("length") and frees its blocks like any other request
POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)


def bad_word_sequences(encode, words: list[str]) -> list[list[int]]:
    """The token sequences a bad_words list bans: each word as written and
    with a leading space (vLLM's semantics); ``encode(text)`` tokenizes
    without special tokens."""
    seqs = set()
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tuple(encode(text))
            if ids:
                seqs.add(ids)
    return [list(ids) for ids in sorted(seqs)]
