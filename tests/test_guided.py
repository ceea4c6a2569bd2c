"""Guided decoding: masks against a brute force over the vocabulary, outputs
validated by the jsonschema package, regex fullmatch, the compile service's
errors, preemption, and a third-party backend."""
from __future__ import annotations

import json
import time
import re

import jsonschema
import numpy as np
import pytest

from fdx import LLM
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.guided import FAST_LANE_CHARS, GuidedAdmission, GuidedDecoding, GuidedRefused, apply_bitmask, constraint_of
from fdx.core.interfaces import GuidedBackend
from fdx.core.plugins import PluginManager
from fdx.core.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

BACKENDS = ("llguidance", pytest.param("xgrammar", marks=pytest.mark.slow))   # xgrammar imports torch: 4 s

# bounded schemas: every output can (and, under the mask, must) end
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "nick": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]}},
     "required": ["name", "nick", "age", "role"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -50, "maximum": 50},
                                                   "y": {"type": "integer", "minimum": -50, "maximum": 50}},
                  "required": ["x", "y"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["point", "tags", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
]


@pytest.fixture(scope="module")
def tokenizer():
    from fdx.model_io.loader import default_model_path, load_tokenizer
    return load_tokenizer(default_model_path())


def service(name: str, tokenizer, vocab_size: int = 49152, **settings) -> GuidedDecoding:
    cfg = FdxConfig.build(None, guided_backend=name, plugins={"guided_backend": {name: settings}} if settings else {})
    return GuidedDecoding.from_config(cfg, PluginManager(load_entry_points=False), tokenizer, vocab_size,
                                      tokenizer.eos_token_ids, warm_up=False)


def allowed_of(bitmask_row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


# -- parameters and the compile service -------------------------------------------------

def test_sampling_params_guided_fields():
    assert constraint_of(SamplingParams(guided_json='{"type": "object"}')) == ("json", '{"type":"object"}')
    assert constraint_of(SamplingParams(guided_choice=["a", "b"])) == ("choice", '["a", "b"]')
    assert constraint_of(SamplingParams()) is None
    for kw, field in [({"guided_json": "{nope"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
                      ({"guided_regex": ""}, "guided_regex"), ({"guided_choice": ["a", 1]}, "guided_choice"),
                      ({"guided_choice": []}, "guided_choice"), ({"guided_grammar": 3}, "guided_grammar"),
                      ({"guided_json_object": "yes"}, "guided_json_object")]:
        with pytest.raises(ValueError, match=f"invalid sampling parameter {field}="):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="guided_json, guided_regex: a request takes at most one"):
        SamplingParams(guided_json={"type": "object"}, guided_regex="a+")


def test_structured_outputs_names_become_the_guided_fields():
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    assert sp.guided_regex == "[a-z]+" and sp.guided_whitespace_flexible and sp.structured_outputs is None
    sp = SamplingParams(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    assert sp.guided_json == {"type": "object"} and not sp.guided_whitespace_flexible
    assert SamplingParams(structured_outputs=GuidedDecodingParams(choice=["a", "b"])).guided_choice == ["a", "b"]
    assert SamplingParams.from_dict(sp.to_dict()) == sp          # one form across the process boundary
    with pytest.raises(ValueError, match="structured_outputs.*'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="structured_outputs.*one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    with pytest.raises(ValueError, match="structured_outputs.*guided_regex is set too"):
        SamplingParams(guided_regex="a", structured_outputs={"choice": ["a"]})


def test_apply_bitmask_matches_a_loop():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 70)).astype(np.float32)
    bitmask = rng.integers(-2 ** 31, 2 ** 31, size=(2, 3), dtype=np.int64).astype(np.int32)
    rows = [1, 3]
    want = logits.copy()
    for j, r in enumerate(rows):
        for t in range(70):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                want[r, t] = -np.inf
    np.testing.assert_array_equal(apply_bitmask(logits.copy(), bitmask, rows), want)


@pytest.mark.parametrize("name", BACKENDS)
def test_choice_mask_equals_brute_force_over_the_vocabulary(name, tokenizer):
    """Along a path through a choice, the allowed tokens are exactly those
    whose text extends the output so far to a prefix of some choice (and eos
    once it is a whole choice): checked against every token of the vocab.
    Once one choice is left, llguidance may allow only the canonical
    tokenization of the forced rest (a subset)."""
    choices = ["yes", "no", "yellow", "maybe so"]
    g = service(name, tokenizer)
    matcher = g.backend.matcher(g.validate(SamplingParams(guided_choice=choices)))
    vocab = 49152
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in range(vocab)]
    eos = set(tokenizer.eos_token_ids)
    out = ""
    for step_text in ["ye", "l", "low", None]:
        bitmask = np.zeros((1, (vocab + 31) // 32), dtype=np.int32)
        matcher.fill_bitmask(bitmask, 0)
        want = {t for t, s in enumerate(texts) if s and any(c.startswith(out + s) for c in choices)}
        if out in choices:
            want |= eos
        allowed = allowed_of(bitmask[0], vocab)
        assert allowed and allowed <= want, out
        if len([c for c in choices if c.startswith(out)]) > 1 or name == "xgrammar":
            assert allowed == want, out       # llguidance may pick the canonical tokens of forced text
        if step_text is None:
            break
        token = texts.index(step_text)
        assert matcher.accept_token(token)
        out += step_text
    assert out == "yellow"
    assert matcher.accept_token(next(iter(eos))) and matcher.is_terminated()
    matcher.rollback(2)                          # eos and "low": "low" is allowed again
    assert matcher.accept_token(texts.index("low"))


@pytest.mark.parametrize("name", BACKENDS)
def test_compile_errors_name_the_field_with_the_compilers_message(name, tokenizer):
    g = service(name, tokenizer)
    for kw, field in [({"guided_json": {"type": "no-such-type"}}, "guided_json"),
                      ({"guided_regex": "(unclosed"}, "guided_regex"),
                      ({"guided_grammar": 'root ::= "a" missing_rule'}, "guided_grammar")]:
        with pytest.raises(ValueError, match=f"^invalid sampling parameter {field}: .+") as e:
            g.validate(SamplingParams(**kw))
        with pytest.raises(ValueError) as again:         # cached: the same error, no recompile
            g.submit(SamplingParams(**kw))
        assert str(again.value) == str(e.value)
    tag = {"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f>"]}
    if name == "llguidance":
        with pytest.raises(ValueError, match="structural_tag.*xgrammar does"):
            g.submit(SamplingParams(structural_tag=tag))
    else:
        assert g.validate(SamplingParams(structural_tag=tag)) is not None


def test_cache_is_keyed_by_constraint_and_admission_waits(tokenizer):
    g = service("llguidance", tokenizer)
    a = g.submit(SamplingParams(guided_regex="[ab]{3}"))
    assert g.submit(SamplingParams(guided_regex="[ab]{3}")) is a
    assert g.submit(SamplingParams(guided_regex="[ab]{3}", guided_whitespace_flexible=True)) is not a
    assert g.submit(SamplingParams(guided_regex="[ab]{4}")) is not a

    class Req:                                   # what the rule reads of a Request
        sampling_params = SamplingParams(guided_regex="x{2}")
    rule = GuidedAdmission(None, guided=g)
    import threading
    gate = threading.Event()
    real = g._compile
    g._compile = lambda key: (gate.wait(30), real(key))[1]    # hold the compile until we look
    try:
        assert rule.admit(Req, None) is False                 # compiling: waits, the queue goes on
        gate.set()
        g.future(Req.sampling_params).result(30)
        assert rule.admit(Req, None) is True
    finally:
        g._compile = real
    assert rule.admit(type("R", (), {"sampling_params": SamplingParams()}), None) is True


def test_compiles_are_capped_timed_out_and_cancelled_when_nobody_waits(tokenizer):
    """The engine side of issue 21's bounds, with large compiles held at a gate."""
    import threading
    g = service("llguidance", tokenizer)
    g.compile_timeout_s, g.max_compiles = 1.5, 3
    g.backend                                 # built before the clock starts
    gate = threading.Event()
    real = g._compile
    g._compile = lambda key: (len(key[2]) > FAST_LANE_CHARS and gate.wait(30), real(key))[1]
    big = lambda i: SamplingParams(guided_choice=[f"{i}" + "x" * FAST_LANE_CHARS])   # noqa: E731
    try:
        for i in range(3):                    # two compile threads: two held, one queued
            assert g.add(f"r{i}", big(i))
        with pytest.raises(GuidedRefused) as e:
            g.add("r3", big(3))
        assert e.value.status == 429 and "max_guided_compiles" in str(e.value)
        assert g.add("small", SamplingParams(guided_regex="[ab]{2}"))    # its own lane: neither refused nor queued
        g.entries["small"].future.result(10)
        ready, failed = g.poll()
        assert ready == ["small"] and failed == []
        g.remove("r2")                         # the queued one's only request left: cancelled before it ran
        assert g.counts["compiles_cancelled"] == 1
        time.sleep(1.6)
        ready, failed = g.poll()
        assert ready == [] and sorted((rid, status) for rid, _, status in failed) == [("r0", 408), ("r1", 408)]
        assert all("guided_compile_timeout_s" in msg for _, msg, _ in failed)
        assert set(g.entries) == {"small"}
    finally:
        gate.set()
        g._compile = real
        g.close()


def test_guided_decoding_is_on_by_default_with_llguidance():
    """The README's install (fdx's own dependencies) answers structured output:
    ``decoding.guided_backend`` defaults to auto, which takes llguidance, an fdx
    dependency; null turns it off."""
    from fdx.core.config import FdxConfig
    from fdx.core.guided import auto_backend
    from fdx.core.plugins import get_plugin_manager
    assert FdxConfig.build().decoding.guided_backend == "auto"
    assert auto_backend(get_plugin_manager()) == "llguidance"
    assert FdxConfig.build(guided_backend="none").decoding.guided_backend == "none"


def test_off_missing_package_and_bad_settings_are_clear_errors(tokenizer):
    off = GuidedDecoding(None, None, tokenizer, 49152, [2])
    with pytest.raises(ValueError, match="guided_regex: guided decoding is off.*decoding.guided_backend"):
        off.submit(SamplingParams(guided_regex="a"))
    assert off.submit(SamplingParams()) is None

    class Missing(GuidedBackend):
        requires = ("fdx_no_such_package_here",)

        def compile(self, kind, spec, whitespace_flexible=False): ...

        def matcher(self, compiled): ...
    with pytest.raises(ConfigError, match="decoding.guided_backend.*fdx_no_such_package_here.*fdx\\[guided\\]"):
        GuidedDecoding("missing", Missing, tokenizer, 49152, [2])
    with pytest.raises(ConfigError, match="plugins.guided_backend.llguidance.bogus"):
        service("llguidance", tokenizer, bogus=1)
    with pytest.raises(ConfigError, match="decoding.guided_backend.*no_such_backend"):
        service("no_such_backend", tokenizer)


@pytest.mark.parametrize("name,key,value", [("llguidance", "log_level", 2), ("xgrammar", "max_threads", 3)])
def test_a_builtin_backend_gets_its_validated_settings_object(tokenizer, name, key, value):
    """Issue 36 item 2: the built-in guided backends are constructed with a
    validated Settings instance (a GuidedSettings), as every kind is, not a dict."""
    from fdx.core.interfaces import GuidedSettings
    svc = service(name, tokenizer, compile_threads=1, **{key: value})
    assert isinstance(svc.settings, GuidedSettings) and getattr(svc.settings, key) == value
    assert svc.settings.compile_threads == 1 and svc.cache_size == 512
    backend = svc.backend
    assert backend.settings is svc.settings or backend.settings == svc.settings
    with pytest.raises(ConfigError, match=f"plugins.guided_backend.{name}.{key}"):
        service(name, tokenizer, **{key: "many"})
    with pytest.raises(ConfigError, match=f"plugins.guided_backend.{name}.cache_size"):
        service(name, tokenizer, cache_size=0)


# -- end to end on a tiny random-weight model: its free output is noise --------------

def tiny_llm(tiny_checkpoints, backend: str, **kw) -> LLM:
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    opts = dict(max_model_len=384, num_kv_blocks=400, block_size=16, max_num_seqs=16, progress=False)
    opts.update(kw)
    return LLM(str(path), guided_backend=backend, **opts)


def check_all(outputs, check) -> None:
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(c.text)


@pytest.mark.parametrize("name", BACKENDS)
def test_tiny_model_outputs_follow_every_constraint(name, tiny_checkpoints):
    llm = tiny_llm(tiny_checkpoints, name)
    free = llm.generate("a b c", SamplingParams(max_tokens=24, temperature=1.0, seed=3))[0].outputs[0]
    with pytest.raises(ValueError):                        # the model alone writes noise
        jsonschema.validate(json.loads(free.text), SCHEMAS[0])
    for schema in SCHEMAS:                                 # sampled at temperature 1: the mask does the work
        sp = SamplingParams(guided_json=schema, max_tokens=200, temperature=1.0, seed=11, n=2)
        check_all(llm.generate(["x", "y z"], sp), lambda t, s=schema: jsonschema.validate(json.loads(t), s))
    regex = r"([0-9]{3}-){2}[A-Z]{2}"
    check_all(llm.generate(["q", "r"], SamplingParams(guided_regex=regex, max_tokens=40, temperature=1.0, seed=5)),
              lambda t: re.fullmatch(regex, t) or pytest.fail(t))
    choices = ["alpha", "beta", "gamma delta"]
    check_all(llm.generate(["s"] * 3, SamplingParams(guided_choice=choices, max_tokens=20, temperature=1.0)),
              lambda t: t in choices or pytest.fail(t))
    grammar = 'root ::= expr\nexpr ::= num | "(" expr " + " expr ")"\nnum ::= [1-9]'
    check_all(llm.generate("t", SamplingParams(guided_grammar=grammar, max_tokens=60, temperature=0.0)),
              lambda t: re.fullmatch(r"[\d()+ ]+", t) and eval(t) > 0 or pytest.fail(t))
    # unconstrained rows in the same batch are untouched, and max_tokens still ends a constrained one
    mixed = llm.generate(["u", "v"], [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                                      SamplingParams(guided_json=SCHEMAS[0], max_tokens=3)])
    assert len(mixed[0].outputs[0].token_ids) == 5
    assert mixed[1].outputs[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("resource_manager,kv_cache", [("v1", "prefix"), ("v1", "paged"), ("v0", "paged")])
def test_preempted_constrained_requests_stay_valid(tiny_checkpoints, resource_manager, kv_cache):
    """A pool too small for the batch forces preemptions (v1) in the middle
    of constrained requests; the matchers are rebuilt and replay the
    outputs. v0 runs the same workload as a scheduler check."""
    llm = tiny_llm(tiny_checkpoints, "llguidance", num_kv_blocks=26, block_size=4, max_model_len=96,
                   resource_manager=resource_manager, kv_cache=kv_cache)
    schema = SCHEMAS[1]
    sp = SamplingParams(guided_json=schema, max_tokens=80, temperature=1.0, seed=2)
    outs = llm.generate([f"prompt {i}" for i in range(8)], sp)
    if resource_manager == "v1":
        assert llm.engine.num_recomputed_tokens > 0        # preemption really happened (v0 did not
                                                           # preempt at these sizes: a scheduler check only)
    check_all(outs, lambda t: jsonschema.validate(json.loads(t), schema))


# -- the embedded model ------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["llguidance", "xgrammar"])
def test_smollm_json_schemas_validate(name):
    llm = LLM(guided_backend=name, max_model_len=256, max_num_seqs=8, num_kv_blocks=128, block_size=16,
              progress=False)
    for schema in SCHEMAS:
        sp = SamplingParams(guided_json=schema, max_tokens=120, temperature=1.0, seed=7, n=2)
        check_all(llm.generate(["Give a JSON example:", "Describe a user as JSON."], sp),
                  lambda t, s=schema: jsonschema.validate(json.loads(t), s))
    # any JSON object (unbounded keys: the noise model would write one key forever; this one ends)
    check_all(llm.generate("Write a small JSON object about a cat:",
                           SamplingParams(guided_json_object=True, max_tokens=120, temperature=0.0)),
              lambda t: isinstance(json.loads(t), dict) or pytest.fail(t))
    with pytest.raises(ValueError, match="invalid sampling parameter guided_json"):
        llm.generate("x", SamplingParams(guided_json={"type": "object", "properties": {"a": {"type": 5}}}))
    assert llm.generate("ok", SamplingParams(max_tokens=2))[0].outputs[0].token_ids     # the engine goes on


# -- a third-party backend ---------------------------------------------------------------

@pytest.mark.slow
def test_third_party_choice_backend(example_plugin_installed, tiny_checkpoints):
    pm = PluginManager()                                   # sees the session's install
    llm = tiny_llm(tiny_checkpoints, "example_choice", plugins=pm)
    choices = ["north", "south west", "east"]
    outs = llm.generate(["a", "b", "c"], SamplingParams(guided_choice=choices, max_tokens=10, temperature=1.0,
                                                        seed=1, n=2))
    check_all(outs, lambda t: t in choices or pytest.fail(t))
    with pytest.raises(ValueError, match="example_choice guided backend does not support json"):
        llm.generate("a", SamplingParams(guided_json={"type": "object"}))
