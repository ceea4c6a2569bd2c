"""The LLM API's contract: prompts in, outputs in order, stops, validation, plugins."""
from __future__ import annotations

import json

import subprocess
import sys

import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from fdx.core.plugins import PluginManager


def test_outputs_in_order_for_mixed_prompt_kinds(smollm_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = smollm_llm.tokenizer.encode("Hello, my name is")
    outs = smollm_llm.generate(["Hello, my name is", {"prompt_token_ids": ids}, "2 + 2 ="], sp)
    assert len(outs) == 3
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    as_numpy = smollm_llm.generate([{"prompt_token_ids": np.asarray(ids)}], sp)[0]
    assert as_numpy.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[2].prompt == "2 + 2 ="
    text = outs[0].outputs[0].text
    assert text == smollm_llm.tokenizer.decode(outs[0].outputs[0].token_ids)


def test_stop_string_is_cut_and_kept_on_request(smollm_llm):
    base = smollm_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    words = base.text.split()
    assert len(words) > 3
    stop = words[2]
    cut = smollm_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[:base.text.index(stop)]
    kept = smollm_llm.generate(["The capital of France is"], SamplingParams(
        temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[:base.text.index(stop) + len(stop)]


def test_stop_token_ids_eos_min_tokens_and_length(smollm_llm):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    base = smollm_llm.generate(["Once upon a time"], sp)[0].outputs[0]
    tok = base.token_ids[5]
    first = base.token_ids.index(tok)
    out = smollm_llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]))[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tok
    # min_tokens forbids the stop token until reached
    out2 = smollm_llm.generate(["Once upon a time"], SamplingParams(
        temperature=0, max_tokens=20, stop_token_ids=[tok], min_tokens=first + 2))[0].outputs[0]
    assert tok not in out2.token_ids[:first + 2]
    # the chat model ends its answer with eos (<|im_end|>) unless ignore_eos
    chat = smollm_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in smollm_llm.tokenizer.eos_token_ids
    assert len(base.token_ids) == 20 and base.finish_reason == "length"


def test_seed_reproduces_and_n_gives_choices(smollm_llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42, ignore_eos=True)
    a = smollm_llm.generate(["Tell me a story"], sp)[0].outputs[0].token_ids
    # the same seed inside a different batch gives the same tokens
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    b = smollm_llm.generate(["Something else", "Tell me a story"], [other, sp])[1].outputs[0].token_ids
    assert a == b
    c = smollm_llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=43, ignore_eos=True))[0].outputs[0].token_ids
    assert a != c
    two = smollm_llm.generate(["Tell me a story"], SamplingParams(temperature=1.0, max_tokens=8, n=2, seed=1))[0]
    assert len(two.outputs) == 2 and [o.index for o in two.outputs] == [0, 1]
    assert two.outputs[0].token_ids != two.outputs[1].token_ids


def test_logprobs_match_a_float64_log_softmax(smollm_llm, hf_logits):
    prompt = "The capital of France is"
    out = smollm_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    ids = smollm_llm.tokenizer.encode(prompt) + out.token_ids
    ref = hf_logits(ids)                                # [T, V] float64 log-softmax
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(ids) - len(out.token_ids) - 1 + i]
        assert lp[tok].rank == 1
        assert abs(lp[tok].logprob - row[tok]) < 1e-3
        top = np.argsort(-row)[:3]
        assert [t for t, v in sorted(lp.items(), key=lambda kv: kv[1].rank)][:3] == top.tolist()


@pytest.mark.parametrize("bad,needle", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_values_are_named(bad, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**bad)


def test_unknown_sampling_key_is_named():
    with pytest.raises(ValueError, match="tempurature"):
        SamplingParams.from_dict({"tempurature": 0.5})


def test_bad_requests_fail_alone_and_engine_goes_on(smollm_llm):
    eng = smollm_llm.engine
    free = eng.kv_cache.num_free_blocks
    with pytest.raises(ValueError, match="max_model_len"):
        smollm_llm.generate(["ok", {"prompt_token_ids": [5] * 600}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        smollm_llm.generate([{"prompt_token_ids": [10**7]}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="unknown prompt key"):
        smollm_llm.generate([{"promt": "x"}])
    assert not eng.has_unfinished() and eng.kv_cache.num_free_blocks == free
    out = smollm_llm.generate(["still serving"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_id_already_in_the_engine_is_refused_and_the_first_goes_on(smollm_llm):
    """A global scheduler's retry of a job still running here once added the
    same request id twice, and the engine died ('runner and scheduler
    disagree ...'). The second add is a ValueError; the first request ends
    with the tokens it would have alone."""
    eng = smollm_llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ids = eng.tokenizer.encode("The sky is")
    alone = smollm_llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
    first = eng.add_request(eng.make_request(ids, sp, request_id="twice"))
    eng.step()                                            # running, with computed tokens
    with pytest.raises(ValueError, match="'twice' is already in the engine"):
        eng.add_request(eng.make_request(ids, sp, request_id="twice"))
    while eng.has_unfinished():
        eng.step()
    assert first.output_token_ids == alone
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


def test_bad_config_is_named(tmp_path):
    from tiny_models import TinyLlama
    model = str(TinyLlama(max_len=512).hf_dir(tmp_path / "tiny"))     # a model is loaded before the block check
    with pytest.raises(ConfigError, match="max_num_sequences"):
        LLM(model, max_num_sequences=4)
    with pytest.raises(ConfigError, match="cache.num_kv_blocks"):
        LLM(model, max_model_len=512, num_kv_blocks=2, block_size=16, progress=False)
    with pytest.raises(ConfigError, match="scheduler.kv_scheduler.*no kv_scheduler named 'v9'; available: .*v1"):
        LLM(model, resource_manager="v9", progress=False)
    with pytest.raises(ConfigError, match="backend.name.*no backend named 'tpu'"):
        LLM(model, backend="tpu", progress=False)


PROMPTS_OF_TWO_LENGTHS = ["A much longer prompt that has quite a few more tokens in it than the other", "Hi"]


def test_third_party_resource_manager_selected_by_config(example_plugin_installed, tiny_checkpoints):
    import fdx_example_plugin as ex
    pm = PluginManager()
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])      # the order of work is the point, not the model
    with LLM(model, max_model_len=256, num_kv_blocks=64, block_size=16, progress=False) as default:
        ref = default.generate(PROMPTS_OF_TWO_LENGTHS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with LLM(model, max_model_len=256, num_kv_blocks=64, block_size=16, resource_manager="example-fifo",
             policy="shortest-first", plugins=pm, progress=False) as llm:
        assert type(llm.engine.resource_manager.policy).__name__ == "FifoScheduler"
        assert ex.STARTED and ex.STARTED[-1]() is llm.engine
        before, added = len(ex.STEPS), len(ex.ADDED)
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(PROMPTS_OF_TWO_LENGTHS, sp)
        step_count = llm.engine.step_count
    # the request hooks: each request seen joining, and finishing with the output the caller got
    assert sorted(ex.ADDED[added:]) == sorted(o.request_id for o in outs)
    assert [ex.OUTPUTS[o.request_id] for o in outs] == [(o.outputs[0].token_ids, "length") for o in outs]
    steps = ex.STEPS[before:]
    assert [s for s, _ in steps] == list(range(steps[0][0], step_count + 1))  # every step seen
    n_prompt = sum(len(o.prompt_token_ids) for o in outs)
    assert sum(t for _, t in steps) == n_prompt + 2 * (6 - 1)     # every token computed once
    # the swap changes the order of work, never what the model says
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.slow
def test_cli_generate_and_bad_flag():
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "generate", "The capital of France is",
                          "--max-tokens", "8", "--max-model-len", "256", "--num-kv-blocks", "32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The capital of France is")
    bad = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "generate", "x", "--set", "blok_size=3"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "blok_size" in bad.stderr and "Traceback" not in bad.stderr


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_llm_chat_with_tools_returns_calls_that_follow_the_schema(smollm_llm, choice):
    """LLM.chat(tools=...) answers as the server does (one parser implementation,
    core/chat_output.py): required and named calls are guaranteed by guided
    decoding (on by default), their arguments valid under the tool's schema."""
    import jsonschema
    out = smollm_llm.chat([{"role": "user", "content": "What is the weather in Paris? And the time?"}],
                          SamplingParams(temperature=0.0, max_tokens=80), tools=[WEATHER, TIME],
                          tool_choice=choice)[0].outputs[0]
    msg = out.message
    assert msg["role"] == "assistant" and msg["content"] is None and msg["tool_calls"], out.text
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in msg["tool_calls"]:
        name = call["function"]["name"]
        assert name in schemas and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[name])
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_time"]
        assert out.finish_reason == "stop"
    else:
        assert out.finish_reason == "tool_calls"
    plain = smollm_llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(temperature=0.0, max_tokens=4))
    assert plain[0].outputs[0].message is None                # no tools, no parser: text only, as before


def test_llm_chat_bad_tools_name_the_field(smollm_llm):
    from fdx.core.chat_output import ChatRequestError
    with pytest.raises(ChatRequestError, match="tool_choice names the function 'nope'") as e:
        smollm_llm.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER],
                        tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ChatRequestError, match="auto.*tool_call_parser"):
        smollm_llm.chat([{"role": "user", "content": "Hi"}], tools=[WEATHER])
