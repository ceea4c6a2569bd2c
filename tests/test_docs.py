"""Every example in docs/plugins.md runs: each Python block is loaded as a
plugin module, selected by config and driven end to end (and through the
conformance kit, as the page tells plugin authors to)."""
from __future__ import annotations

import pathlib
import re
import types

import pytest
import yaml

from fdx import LLM, SamplingParams
from fdx.core.config import FdxConfig
from fdx.core.plugins import get_plugin_manager

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture(scope="module")
def doc_plugins():
    """The page's plugin modules, registered in the process's plugin manager."""
    pm = get_plugin_manager()
    modules = {}
    for i, code in enumerate(blocks("python")):
        if "@hookimpl" not in code:
            continue
        mod = types.ModuleType(f"docs_plugin_{i}")
        exec(compile(code, f"docs/plugins.md block {i}", "exec"), mod.__dict__)
        pm.add_plugin(mod, name=mod.__name__)
        modules[i] = mod
    return pm, modules


def test_the_page_has_every_contract(doc_plugins):
    pm, _ = doc_plugins
    for kind, name in [("resource_manager", "my-fifo"), ("queue_policy", "longest-first"),
                       ("admission_rule", "my-cap"), ("preemption_policy", "my-oldest"),
                       ("kv_cache", "my-blocks"), ("logits_processor", "my-ban"), ("backend", "my-device"),
                       ("attention_backend", "my-dense"), ("connector", "my-counter"),
                       ("backend", "my-probing-device"), ("weight_format", "my-int8"), ("observer", "my-latency"),
                       ("activation_function", "my-scale"), ("moe_router", "my-drop-last"),
                       ("proposer", "my-repeat"), ("lora_loader", "my-npz"),
                       ("token_processor", "my-limit"), ("sampler", "my-greedy"), ("model_runner", "my-counting"),
                       ("scheduler", "my-counted")]:
        assert name in pm.names(kind), (kind, name)
        assert pm.registries[kind][name].package == "local"


def test_the_yaml_example_is_a_valid_config(tmp_path):
    (yml,) = [b for b in blocks("yaml") if "plugins:" in b]
    path = tmp_path / "fdx.yaml"
    path.write_text(yml)
    cfg = FdxConfig.build(str(path))
    assert cfg.scheduler.kv_scheduler == "my-fifo" and cfg.plugins["admission_rule"]["my-cap"] == {"max_running": 2}
    assert yaml.safe_load(yml)["decoding"]["logits_processors"] == ["my-ban"]


def test_the_conformance_kit_block_runs_on_the_page_plugins(doc_plugins):
    (code,) = [b for b in blocks("python") if "check_scheduler(" in b and "def test_" in b]
    ns: dict = {}
    exec(compile(code, "docs/plugins.md kit block", "exec"), ns)
    tests = [v for k, v in ns.items() if k.startswith("test_")]
    assert len(tests) == 2
    for t in tests:
        t()


def test_the_page_proposer_passes_the_kit_and_keeps_outputs(doc_plugins, tiny_checkpoints):
    (code,) = [b for b in blocks("python") if "check_proposer(" in b and "def test_" in b]
    ns: dict = {}
    exec(compile(code, "docs/plugins.md proposer kit block", "exec"), ns)
    ns["test_my_proposer_is_lossless"]()
    path = str(tiny_checkpoints["LlamaForCausalLM"][0])
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31] * 4}]
    base = dict(max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    ref = [o.outputs[0].token_ids for o in LLM(path, **base).generate(prompts, sp)]
    llm = LLM(path, **base, speculative_config={"method": "my-repeat", "cost_gate": False},
              **{"plugins.proposer.my-repeat.period": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert llm.engine.speculation.counters.num_drafts > 0 and llm.engine.speculation.proposer.settings.period == 2


def test_the_page_plugins_run_a_real_model_together(doc_plugins, tiny_checkpoints):
    _, modules = doc_plugins
    path = str(tiny_checkpoints["Qwen2ForCausalLM"][0])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7]}, {"prompt_token_ids": list(range(60, 90))}]
    base = dict(max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    ref = [o.outputs[0].token_ids for o in LLM(path, **base).generate(prompts, sp)]
    llm = LLM(path, **base, kv_scheduler="my-fifo", policy="longest-first", preemption="my-oldest",
              kv_cache="my-blocks", backend="my-device", kv_connector="my-counter", logits_processors=["my-ban"],
              admission=["my-cap"], **{"plugins.admission_rule.my-cap": {"max_running": 2}})
    assert type(llm.engine.attention).__name__ == "DenseAttention"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    banned = ref[0][:2]
    out = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   extra_args={"ban": banned}))[0].outputs[0].token_ids
    assert not set(out) & set(banned)
    assert llm.engine.connector.finished == 3
    observer = next(m for m in modules.values() if hasattr(m, "SEEN"))
    assert observer.SEEN and all(used >= 0 for _, _, used, _ in observer.SEEN)


def test_the_page_observer_sees_every_request_it_is_selected_for(doc_plugins, tiny_checkpoints):
    path = str(tiny_checkpoints["Qwen2ForCausalLM"][0])
    base = dict(max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    llm = LLM(path, **base, observers=["my-latency"], **{"plugins.observer.my-latency": {"slow_s": 0}})
    (obs,) = llm.engine.observers
    outs = llm.generate([{"prompt_token_ids": [5, 9, 200]}, {"prompt_token_ids": [7] * 20}],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 6)])
    assert sorted((rid, n) for rid, _, n in obs.rows) == sorted((o.request_id, len(o.outputs[0].token_ids))
                                                               for o in outs)
    assert all(ttft > 0 for _, ttft, _ in obs.rows) and sorted(obs.slow) == sorted(o.request_id for o in outs)
    assert LLM(path, **base).engine.observers == []            # not selected: not built


def test_the_page_backend_with_a_kernel_table_runs_what_it_passed(doc_plugins, tiny_checkpoints, monkeypatch):
    import paddle.nn.functional as F
    path = str(tiny_checkpoints["LlamaForCausalLM"][0])
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31, 7]}]
    base = dict(max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    ref = [o.outputs[0].token_ids for o in LLM(path, **base).generate(prompts, sp)]
    llm = LLM(path, **base, backend="my-probing-device")
    assert llm.engine.backend.kernels.findings == {"swiglu": None}
    calls = []
    real = F.swiglu
    monkeypatch.setattr(F, "swiglu", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert calls                                              # its table passed swiglu: the MLPs ran it


def test_the_page_weight_format_matches_transformers_on_its_int8_values(doc_plugins, tiny_checkpoints):
    """Every matrix in per-row int8: fdx's greedy tokens equal transformers'
    run on the same round trip (tied head included)."""
    import copy

    import numpy as np
    import torch

    from test_llm import hf_greedy
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for p in ref.parameters():
            if p.ndim == 2:
                w = p.numpy()
                scale = np.abs(w).max(axis=1, keepdims=True) / 127
                scale[scale == 0] = 1                               # the padding row of the embedding
                p.copy_(torch.from_numpy((np.rint(w / scale) * scale).astype(np.float32)))
    llm = LLM(str(path), quantization="my-int8", max_model_len=64, num_kv_blocks=40, block_size=4, progress=False)
    assert set(llm.engine.model.weight_bytes()) == {"my-int8", "f32"}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for ids in ([5, 9, 200, 31, 7], list(range(60, 90))):
        got = llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0].token_ids
        assert got == hf_greedy(ref, ids, 8, follow=got)


def test_the_page_chat_parsers_give_openai_messages(doc_plugins):
    """The page's tool and reasoning parsers, found by name as the server
    finds them, through the server's per-choice seam (ChoiceOutput), whole
    and streamed (their default stream)."""
    from fdx.core.chat_output import ChoiceOutput, ToolPlan
    from fdx.core.interfaces import BuildContext
    pm, _ = doc_plugins
    assert {"my-actions"} <= set(pm.names("tool_parser")) and "my-notes" in pm.names("reasoning_parser")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]

    def output():
        notes = pm.get("reasoning_parser", "my-notes")(None)
        notes.begin("prompt")
        actions = pm.get("tool_parser", "my-actions")(None, BuildContext(tools=tools))
        return ChoiceOutput(ToolPlan("auto", tools), notes, actions)
    text = '<note>use f</note>Calling.\nCALL f {"x": 1}'
    one = output()
    msg = one.message(text)
    assert (msg["reasoning_content"], msg["content"]) == ("use f", "Calling.")
    assert msg["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert one.finish_reason("stop") == "tool_calls"
    streamed = output()
    deltas = [streamed.delta(text[:9], False), streamed.delta(text[9:], True)]
    assert deltas[0] == {} and deltas[1]["reasoning_content"] == "use f" and deltas[1]["content"] == "Calling."
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}


def test_the_page_says_how_every_kind_is_constructed():
    """docs/plugins.md's table of constructor shapes has a row for every
    plugin kind the plugin manager knows (a new kind must say how fdx
    builds it), and no row for a kind that is gone."""
    from fdx.core.plugins import KINDS
    text = DOC.read_text()
    table = text[text.index("| kind (`plugins.<kind>`) |"):]
    rows = re.findall(r"^\| `([a-z_]+)` \|", table[:table.index("\n\n")], flags=re.M)
    assert sorted(rows) == sorted(KINDS.values())
