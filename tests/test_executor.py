"""The executor at every tensor parallel size (issue 40 item 1): the engine
reaches the model only through an ``Executor`` (in process at TP 1, worker
processes above), each rank runs the runner class config names, and every
feature that runs at TP 1 gives TP 1's greedy output at TP 2 and TP 3,
checked pairwise on a tiny random checkpoint (tests/tiny_models.py, 6 heads
and 6 KV heads: both sizes divide them) with the SmolLM2 tokenizer.

A TP all-reduce sums each row in another order than one rank does, so two
candidates closer than that rounding may swap: where a token differs, the
test computes the margin between the two tokens from TP 1's logits (the
processors' effect added) and requires it within how far TP 1's and TP N's
logits of that row differ, itself float32 rounding; the outputs are then
compared up to that token only. Combinations that cannot run are config
errors naming the key, raised before any worker starts.
"""
from __future__ import annotations

import json
import re
import shutil
from collections import defaultdict

import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from fdx.core.hookspecs import hookimpl
from fdx.core.plugins import PluginManager

TINY = dict(max_model_len=96, num_kv_blocks=48, block_size=8, progress=False)
ROUNDING = 1e-3          # float32 all-reduce order: TP 1 and TP N logits of a row differ by well under this
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
BIAS = {11: 6.0, 28: 3.0}


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory, smollm_hf_tokenizer_dir):
    """A random Llama whose heads (6), KV heads (6) and MLP width (96)
    divide by 2 and 3, with the SmolLM2 vocabulary and tokenizer."""
    from tiny_models import TinyLlama
    path = TinyLlama(vocab=49152, hidden=48, intermediate=96, layers=2, heads=6, kv_heads=6, max_len=128,
                     seed=5, scale=0.3).hf_dir(tmp_path_factory.mktemp("tp") / "model")
    for f in smollm_hf_tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="module")
def tiny_w(tmp_path_factory):
    """The same shape with tiny_models' own word-level vocabulary (64 ids):
    cheap, for what needs no real tokenizer."""
    from tiny_models import TinyLlama
    return TinyLlama(vocab=64, hidden=48, intermediate=96, layers=2, heads=6, kv_heads=6, max_len=128,
                     seed=5).hf_dir(tmp_path_factory.mktemp("tpw") / "model")


def features() -> list[tuple[str, SamplingParams]]:
    g = dict(temperature=0.0)
    return [("plain", SamplingParams(max_tokens=10, ignore_eos=True, **g)),
            ("regex", SamplingParams(guided_regex=r"[0-9]{3}-[a-z]{2}", max_tokens=16, **g)),
            ("choice", SamplingParams(guided_choice=["Paris", "London", "Rome"], max_tokens=8, **g)),
            ("json", SamplingParams(guided_json=SCHEMA, max_tokens=24, **g)),
            ("processor", SamplingParams(logit_bias=BIAS, max_tokens=10, ignore_eos=True, **g)),
            ("prompt_logprobs", SamplingParams(prompt_logprobs=2, logprobs=2, max_tokens=6, ignore_eos=True, **g))]


PROMPTS = [[504, 3575, 282, 4649, 314], [1812, 7, 2022, 17], [31, 2, 9, 441, 80, 8, 1000]]


class LogitsTap:
    """Each request's raw logits rows, in the order it sampled them."""

    def __init__(self):
        self.rows: dict[str, list[np.ndarray]] = defaultdict(list)

    @hookimpl
    def fdx_step_finished(self, context):
        for i, rid in enumerate(context.sampled_request_ids or []):
            self.rows[rid].append(np.array(context.logits[i], dtype=np.float64))


def run(path, tp: int, **kw):
    """{feature: (tokens, text, that request's logits rows, prompt logprobs)} at ``tp``."""
    pm = PluginManager(load_entry_points=False)
    tap = LogitsTap()
    pm.add_plugin(tap, name="logits-tap")
    names, params = zip(*features())
    reqs = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(params))]
    with LLM(str(path), plugins=pm, tensor_parallel_size=tp, guided_backend="llguidance", capture_logits=True,
             **TINY, **kw) as llm:
        assert type(llm.engine.executor).__name__ == ("UniProcExecutor" if tp == 1 else "TensorParallelExecutor")
        outs = llm.generate(reqs, list(params))
    return {n: (o.outputs[0].token_ids, o.outputs[0].text, tap.rows[o.request_id], o.prompt_logprobs)
            for n, o in zip(names, outs)}


def processed(name: str, row: np.ndarray) -> np.ndarray:
    """A raw logits row as the sampler saw it (the feature's additive bias;
    a guided mask only removes candidates, both of which it allowed)."""
    row = row.copy()
    if name == "processor":
        for t, b in BIAS.items():
            row[t] += b
    return row


def agreed_prefix(name: str, ref, got, tp: int) -> int:
    """How many leading tokens TP 1 and TP ``tp`` share; where they part,
    the two candidates must be a near tie: TP 1's margin between them no
    more than how far the two runs' logits of that row differ (rounding)."""
    (a, _, la, _), (b, _, lb, _) = ref, got
    for k, (x, y) in enumerate(zip(a, b)):
        drift = float(np.abs(la[k] - lb[k]).max())
        assert drift < ROUNDING, f"{name} TP {tp}: token {k}'s logits differ by {drift} from TP 1's"
        if x != y:
            row = processed(name, la[k])
            margin = float(row[x] - row[y])
            assert 0 <= margin <= 2 * drift, (f"{name} TP {tp}: token {k} is {y}, TP 1's {x}, and TP 1's margin "
                                              f"between them is {margin} (rounding {drift}): not a near tie")
            return k
    assert len(a) == len(b), (name, a, b)
    return len(a)


def check_constraint(name: str, text: str) -> None:
    """The guided outputs obey their constraint (checked on the text alone)."""
    if name == "regex":
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    elif name == "choice":
        assert text in ("Paris", "London", "Rome"), text
    elif name == "json":
        assert isinstance(json.loads(text)["ok"], bool), text


@pytest.mark.slow
def test_every_feature_at_tp2_and_tp3_equals_tp1(tiny_tp):
    """Guided regex, choice and JSON, a logits processor (logit_bias), prompt
    logprobs and logprobs: TP 2 (with ``backend.model_runner: default``
    named, which used to build an engine with no KV cache) and TP 3 against
    TP 1, token for token (near ties aside, with their margin shown)."""
    ref = run(tiny_tp, 1)
    for name, (tokens, text, rows, _) in ref.items():
        assert len(rows) == len(tokens), name
        check_constraint(name, text)
    for tp, kw in ((2, {"backend.model_runner": "default"}), (3, {})):
        got = run(tiny_tp, tp, **kw)
        for name in ref:
            n = agreed_prefix(name, ref[name], got[name], tp)
            if n == len(ref[name][0]):
                assert got[name][1] == ref[name][1], name
                check_constraint(name, got[name][1])
        pa, pb = ref["prompt_logprobs"][3], got["prompt_logprobs"][3]
        assert len(pa) == len(pb) == len(PROMPTS[5 % len(PROMPTS)])
        for da, db in zip(pa[1:], pb[1:]):
            assert da.keys() == db.keys()
            for t in da:
                assert abs(da[t].logprob - db[t].logprob) < ROUNDING


# -- what cannot run is a config error naming the key, before any worker starts --------

def test_a_runner_without_the_rank_contract_is_refused_at_tp2(tiny_w):
    from fdx.plugins.backends.runner import DefaultModelRunner

    class Plain(DefaultModelRunner):
        tensor_parallel = False

    class Register:
        @hookimpl
        def fdx_register_model_runners(self, register):
            register("plain", Plain)

    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Register(), name="plain-runner")
    with pytest.raises(ConfigError, match=r"config key 'backend\.model_runner'.*'plain' does not run under tensor"):
        LLM(str(tiny_w), plugins=pm, tensor_parallel_size=2, **{"backend.model_runner": "plain"}, **TINY)
    with LLM(str(tiny_w), plugins=pm, **{"backend.model_runner": "plain"}, **TINY) as llm:     # runs at TP 1
        assert type(llm.engine.runner) is Plain


def test_what_cannot_run_at_tp_n_names_its_key(tiny_w):
    cases = [(dict(task="embed"), "model.task"),
             (dict(swap_max_blocks=8), "cache.kv_connector"),
             ({"backend.model_runner": "tp"}, "backend.model_runner"),      # an executor, not a runner
             ({"parallel.runner": "default"}, "parallel.runner"),          # a runner, not an executor
             (dict(tensor_parallel_size=4), "parallel.tensor_parallel_size")]   # 6 heads over 4 ranks
    for kw, key in cases:
        kw = {"tensor_parallel_size": 2, **kw}
        with pytest.raises(ConfigError, match=re.escape(f"config key '{key}'")):
            LLM(str(tiny_w), **kw, **TINY)


def test_tp1_runs_through_the_in_process_executor(tiny_w):
    """The engine holds no model of its own: ``model``, ``runner`` and the
    KV tensors are the executor's; reconfigure rebuilds its runner side over
    the same model and tensors."""
    from fdx.core.executor import UniProcExecutor
    with LLM(str(tiny_w), **TINY) as llm:
        eng = llm.engine
        ex = eng.executor
        assert isinstance(ex, UniProcExecutor) and eng.model is ex.model and eng.kv_caches is ex.kv_caches
        assert eng.shape.num_heads == 6 and eng.shape.vocab_size == 64
        assert eng.kv_budget is None                           # num_kv_blocks was given: no profile
        assert ex.weight_bytes() == eng.model.weight_bytes()
        ps = [{"prompt_token_ids": [3, 9, 27, 40]}, {"prompt_token_ids": [5, 6]}]
        before = [o.outputs[0].token_ids for o in llm.generate(ps, features()[0][1])]
        runner, model, kv = eng.runner, eng.model, eng.kv_caches
        eng.reconfigure(seed=3, max_num_seqs=1)
        assert eng.runner is not runner and eng.model is model and eng.kv_caches is kv
        after = [o.outputs[0].token_ids for o in llm.generate(ps, features()[0][1])]
    assert after == before


@pytest.mark.slow
def test_a_config_error_after_the_workers_load_leaves_no_worker(tiny_w):
    """``model.max_model_len`` is checked against the shape the executor
    reports, after the ranks have loaded: the error names the key and the
    engine closes its executor, so no worker process is left."""
    import os
    import pathlib

    def tp_children() -> list[int]:
        me = os.getpid()
        kids = pathlib.Path(f"/proc/{me}/task/{me}/children").read_text().split()
        return [int(p) for p in kids if pathlib.Path(f"/proc/{p}").exists()
                and b"fdx.plugins.backends.tp" in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()]

    with pytest.raises(ConfigError, match=re.escape("config key 'model.max_model_len'")):
        LLM(str(tiny_w), tensor_parallel_size=2, **{**TINY, "max_model_len": 1000})
    assert tp_children() == []
