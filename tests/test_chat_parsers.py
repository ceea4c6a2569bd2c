"""The built-in tool-call and reasoning parsers against recorded outputs of
each family (tests/data/chat_parser_outputs.json says where each came from),
malformed ones included; streaming, fed the text in random pieces, adds up
to the whole-text result; the tool plan's guided schemas; the Qwen3 chat
template rendered with tools, tool turns and enable_thinking as
transformers renders it."""
from __future__ import annotations

import json
import pathlib
import random

import jsonschema
import numpy as np
import pytest

from fdx.core.interfaces import BuildContext
from fdx.core.plugins import SERVING_PLUGINS, PluginManager
from fdx.core.sampling_params import SamplingParams as SP
from fdx.core.chat_output import ChatRequestError, ChoiceOutput, ToolPlan, tool_plan
from fdx.entrypoints.serving.protocol import APIError, ChatCompletionRequest

DATA = pathlib.Path(__file__).parent / "data"
CASES = json.loads((DATA / "chat_parser_outputs.json").read_text())


@pytest.fixture(scope="module")
def registry():
    """The parsers as the API process of fdx serve finds them."""
    return PluginManager(builtins=SERVING_PLUGINS, load_entry_points=False)


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def streamed_tools(parser, pieces):
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        d = parser.stream(piece, k == len(pieces) - 1)
        content += d.content
        for tc in d.tool_calls:
            call = calls.setdefault(tc.index, [None, ""])
            if tc.name is not None:
                assert call[0] is None, "a call's name comes once, in its first piece"
                call[0] = tc.name
            else:
                assert call[0] is not None, "arguments before the name"
            call[1] += tc.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("case", CASES["tool"], ids=lambda c: f"{c['parser']}-{c['source']}-{c['text'][:20]}")
def test_tool_parser_reads_recorded_output(registry, case):
    cls = registry.get("tool_parser", case["parser"])
    result = cls(None).extract(case["text"])
    assert (result.content or "").strip() == (case["content"] or "").strip()
    assert (result.content is None) == (case["content"] is None)
    assert [c.name for c in result.tool_calls] == [name for name, _ in case["calls"]]
    for call, (_, args) in zip(result.tool_calls, case["calls"]):
        if isinstance(args, dict):
            assert json.loads(call.arguments) == args
        else:                                  # a broken call: its arguments as the model wrote them
            assert call.arguments == args
    rng = random.Random(case["text"])
    for _ in range(40):
        content, calls = streamed_tools(cls(None), splits(case["text"], rng))
        assert calls == [(c.name, c.arguments) for c in result.tool_calls]
        assert (content if content.strip() else None) == result.content


@pytest.mark.parametrize("case", CASES["reasoning"], ids=lambda c: f"{c['parser']}-{c['source']}-{c['text'][:20]}")
def test_reasoning_parser_reads_recorded_output(registry, case):
    cls = registry.get("reasoning_parser", case["parser"])

    def parser():
        p = cls(None)
        p.begin("<|im_start|>user\nq<|im_end|>\n" + case["prompt_end"])
        return p
    result = parser().extract(case["text"])
    assert (result.reasoning, result.content) == (case["reasoning"], case["content"])
    rng = random.Random(case["text"])
    for _ in range(40):
        p, reasoning, content = parser(), "", ""
        pieces = splits(case["text"], rng)
        for k, piece in enumerate(pieces):
            d = p.stream(piece, k == len(pieces) - 1)
            reasoning += d.reasoning or ""
            content += d.content or ""
        assert (reasoning or None, content or None) == (result.reasoning, result.content), pieces


def test_parsers_never_raise_on_junk(registry):
    rng = random.Random(7)
    alphabet = ['{', '}', '"', ':', ',', 'name', 'arguments', '<tool_call>', '</tool_call>', '<think>', '</think>',
                '<response>', ';', '<|python_tag|>', ' ', '\n', 'x', '[', '\\']
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        for name in registry.names("tool_parser"):
            whole = registry.get("tool_parser", name)(None).extract(text)
            _, calls = streamed_tools(registry.get("tool_parser", name)(None), splits(text, rng) if text else [""])
            assert calls == [(c.name, c.arguments) for c in whole.tool_calls], (name, text)
        for name in registry.names("reasoning_parser"):
            p = registry.get("reasoning_parser", name)(None)
            p.begin("")
            p.extract(text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False}}}


class _SC:
    enable_auto_tool_choice = True
    tool_call_parser = "hermes"


def _req(**kw):
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


def test_required_and_named_schemas_admit_exactly_valid_calls():
    plan = tool_plan(_req(tools=[WEATHER, TIME], tool_choice="required"), _SC)
    schema = plan.guided_json()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}},
                         {"name": "get_time", "parameters": {"tz": "UTC"}}], schema)
    for bad in ([], [{"name": "get_time", "parameters": {"city": "Rome"}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_weather"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = tool_plan(_req(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), _SC)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {"tz": "a"}}] * 2, single.guided_json())
    named = tool_plan(_req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}),
                      _SC)
    assert named.mode == "named" and named.guided_json() == TIME["function"]["parameters"]

    out = ChoiceOutput(plan)
    msg = out.message('[{"name":"get_weather","parameters":{"city":"Rome"}},{"name":"get_time","parameters":{"tz":"UTC"}}]')
    assert msg["content"] is None and [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert len({c["id"] for c in msg["tool_calls"]}) == 2 and out.finish_reason("stop") == "tool_calls"
    cut = ChoiceOutput(plan).message('[{"name":"get_weather","param')      # cut at max_tokens: content
    assert cut["tool_calls"] == [] and cut["content"] == '[{"name":"get_weather","param'
    named_out = ChoiceOutput(named)
    assert named_out.message('{"tz":"UTC"}')["tool_calls"][0]["function"] == {"name": "get_time",
                                                                             "arguments": '{"tz":"UTC"}'}
    assert named_out.finish_reason("stop") == "stop"      # as OpenAI answers a forced function


@pytest.mark.parametrize("kw,param,words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "name"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "function"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice",
     "not among tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "not one of"),
])
def test_bad_tool_fields_name_the_field(kw, param, words):
    with pytest.raises(ChatRequestError) as e:
        tool_plan(_req(**kw), _SC)
    assert e.value.param == param and words in e.value.message


def test_auto_needs_the_server_flags():
    class Off:
        enable_auto_tool_choice = False
        tool_call_parser = None
    with pytest.raises(ChatRequestError, match="--enable-auto-tool-choice") as e:
        tool_plan(_req(tools=[WEATHER]), Off)
    assert e.value.param == "tool_choice"
    assert tool_plan(_req(tools=[WEATHER], tool_choice="required"), Off).mode == "required"
    assert tool_plan(_req(tools=[WEATHER], tool_choice="none"), Off).mode == "none"


@pytest.fixture(scope="module")
def qwen3_tokenizer_dir(tmp_path_factory):
    """A tokenizer folder (a small word-level vocabulary) carrying Qwen3's
    chat template, which fdx and transformers both read."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = tmp_path_factory.mktemp("qwen3_tok")
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<|im_end|>": 1, "<|endoftext|>": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": "[UNK]", "chat_template": (DATA / "qwen3_chat_template.jinja").read_text()}))
    return d


CONVERSATION = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Weather in Rome and the time in UTC?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]


@pytest.mark.parametrize("thinking", [None, False])
def test_qwen3_template_gets_tools_tool_turns_and_enable_thinking(qwen3_tokenizer_dir, thinking):
    import transformers

    from fdx.model_io.tokenizer import Tokenizer
    from fdx.entrypoints.serving.rendering import Renderer
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    req = ChatCompletionRequest(messages=CONVERSATION, tools=[WEATHER, TIME], chat_template_kwargs=kwargs or None)
    text, _ = Renderer(Tokenizer.from_hf_dir(qwen3_tokenizer_dir), "m").chat_prompt(req)
    ref_messages = json.loads(json.dumps(CONVERSATION))
    ref_messages[2]["content"] = ""                     # OpenAI's null content: empty text
    for call in ref_messages[2]["tool_calls"]:           # transformers' convention: arguments as a dict
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir)).apply_chat_template(
        ref_messages, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True, **kwargs)
    assert text == ref
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n12:00\n</tool_response>" in text and '"name": "get_time"' in text
    assert text.endswith("<think>\n\n</think>\n\n") == (thinking is False)
    # the qwen3 reasoning parser reads the closed think block: what follows is all answer
    from fdx.plugins.parsers.reasoning_parsers import Qwen3ReasoningParser
    p = Qwen3ReasoningParser(None)
    assert p.begin(text) is (False if thinking is False else None)


def test_serve_flags_set_the_parser_keys():
    from fdx.entrypoints.cli import build_parser
    from fdx.entrypoints.serving.cli import server_config
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json", "--enable-auto-tool-choice",
                                      "--reasoning-parser", "deepseek_r1"])
    sc = server_config(args).server
    assert (sc.tool_call_parser, sc.enable_auto_tool_choice, sc.reasoning_parser) == ("llama3_json", True,
                                                                                      "deepseek_r1")
    sc = server_config(build_parser().parse_args(["serve"])).server
    assert (sc.tool_call_parser, sc.enable_auto_tool_choice, sc.reasoning_parser) == (None, False, None)


@pytest.mark.parametrize("keys,named", [({"server.tool_call_parser": "nope"}, "server.tool_call_parser"),
                                        ({"server.reasoning_parser": "nope"}, "server.reasoning_parser"),
                                        ({"server.enable_auto_tool_choice": True}, "server.enable_auto_tool_choice")])
def test_a_bad_parser_setting_is_a_config_error_naming_the_key(keys, named):
    from fdx.core.config import ConfigError, FdxConfig
    from fdx.entrypoints.serving.app import Server
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as e:
        Server(FdxConfig.build(None, **keys))
    if "nope" in keys.values():
        assert "hermes" in str(e.value) or "qwen3" in str(e.value)      # what there is


def test_reasoning_budget_forces_the_end_tokens_after_the_budget():
    """The reasoning_budget processor against a recompute by hand: past
    ``budget`` tokens with no end sequence, row i may only take end[k]."""
    from fdx.core.interfaces import BatchUpdate, BuildContext, RowState
    from fdx.plugins.decoding.logits_processors import ReasoningBudget
    end = [7, 8, 9]
    proc = ReasoningBudget(None, BuildContext(vocab_size=20))
    outs = {"a": [1, 2], "b": [1, 2, 3], "c": [1, 2, 3, 7], "d": [7, 8, 9, 1], "e": [1, 2, 3, 7, 8, 9]}
    params = SP(max_tokens=None, reasoning_max_tokens=3, reasoning_end_token_ids=end)
    rows = list(outs)
    proc.update_state(BatchUpdate([RowState(r, params, [0], outs[r]) for r in rows], [], rows, True))
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((len(rows), 20)).astype(np.float32)
    got = proc.apply(logits.copy())
    for i, r in enumerate(rows):
        out = outs[r]
        k = len(out) - 3
        ended = any(out[j:j + 3] == end for j in range(0, min(len(out), 3) - 2))
        if 0 <= k < 3 and not ended:
            assert np.isneginf(np.delete(got[i], end[k])).all() and got[i, end[k]] == 0, r
        else:
            np.testing.assert_array_equal(got[i], logits[i], err_msg=r)


def test_tools_are_bounded_like_a_guided_schema():
    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving import edge
    sc = ServerConfig(max_guided_bytes=2000)
    many = [{"type": "function", "function": {"name": f"f{i}", "parameters": WEATHER["function"]["parameters"]}}
            for i in range(40)]
    with pytest.raises(APIError) as e:
        edge.check_limits(_req(tools=many, tool_choice="required"), sc, 100)
    assert e.value.status == 400 and e.value.param == "tools" and "2000" in e.value.message
    edge.check_limits(_req(tools=many[:2], tool_choice="required"), sc, 100)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_keeps_one_call_without_parallel_tool_calls(registry, parallel):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    plan = tool_plan(_req(tools=[WEATHER, TIME], parallel_tool_calls=parallel), _SC)
    hermes = registry.get("tool_parser", "hermes")
    msg = ChoiceOutput(plan, None, hermes(None, BuildContext(tools=plan.tools))).message(text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"][:2 if parallel else 1]
    streamed = ChoiceOutput(plan, None, hermes(None, BuildContext(tools=plan.tools)))
    pieces = [streamed.delta(text[i:i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)]
    names = [tc["function"]["name"] for d in pieces for tc in d.get("tool_calls", []) if "name" in tc["function"]]
    assert names == [c["function"]["name"] for c in msg["tool_calls"]]
