"""Expert parallel (issue 39 item 3) and the expert-load tap under tensor
parallel (item 5), on a tiny random Qwen3-MoE the tests write with numpy
(tests/test_moe_grouped.py's writer: hidden 64, 4 heads, 8 experts, top-2,
layer 1 dense).

- in one process: the ranks' models, each holding its group's experts (built
  so, or sharded after a whole build), give partial MoE outputs that sum to
  the whole layer's, and route as the whole one does;
- bad combinations are config errors naming the key, before any worker starts;
- through the engine (slow: worker processes): EP 2 (tensor_parallel_size 2,
  expert_parallel_size 2) and TP 4 x EP 2 give one rank's greedy tokens, each
  step's expert load is one rank's, and every KV block is free at the end.
"""
from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdx.model_io.loader import load_checkpoint
from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import BuildContext
from fdx.plugins.models.moe_config import ExpertShare, building_share
from fdx.plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from test_moe_grouped import E, K, checkpoints, write_qwen3_moe  # noqa: F401  (checkpoints: a fixture)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("moe_ep"), kv=4)


def _model(folder, share: ExpertShare | None = None) -> Qwen3MoeForCausalLM:
    ck = load_checkpoint(str(folder), progress=False)
    with building_share(share):
        return Qwen3MoeForCausalLM({}, BuildContext(hf_config=ck.config, weights=ck.weights))


@pytest.mark.parametrize("world,groups", [(2, 2), (4, 2), (4, 4), (2, 1)])
def test_ranks_partial_outputs_sum_to_the_whole_layer(folder, world, groups):
    whole = _model(folder)
    ranks = []
    for r in range(world):        # odd ranks built holding their share only, even ones sharded after a whole build
        m = _model(folder, ExpertShare(r, world, groups) if r % 2 else None)
        m.shard(r, world, lambda t: t, groups)        # no sum here: each rank's output is its partial one
        ranks.append(m)
    rng = np.random.default_rng(world * 10 + groups)
    for rows in (9, 1):
        x = paddle.to_tensor(rng.standard_normal((rows, 64)).astype(np.float32))
        for i in whole.moe.moe_layers:
            block, parts = whole.layers[i].mlp, [m.layers[i].mlp for m in ranks]
            for r, part in enumerate(parts):
                first, end = ExpertShare(r, world, groups).experts(E)
                assert part.experts_held == (first, end) and len(part.w_gate_up) == len(part.w_down) == E // groups
                assert part.w_gate_up[0].shape == (2 * 32 * groups // world, 64)
            got = sum(part(x).numpy() for part in parts)
            np.testing.assert_allclose(got, block(x).numpy(), atol=1e-5, rtol=0)
            assert all(np.array_equal(part.last_load, block.last_load) for part in parts)   # every rank routes all
            assert block.last_load.sum() == rows * K


def test_q8_0_gguf_ranks_keep_their_experts_quantized(checkpoints):
    """The GGUF file's stacked Q8_0 experts: each rank takes its experts'
    rows of the file's bytes only, keeps them in Q8_0, runs them through the
    grouped call (its own stack of E/2 experts), and the partial outputs sum
    to the whole layer's."""
    from fdx.core import kernels
    from fdx.plugins.models.weight_formats import AutoFormat, weight_bytes
    from test_contracts import cpu_kernel_table
    _, q8 = checkpoints
    table = cpu_kernel_table()

    def model(share=None):
        ck = load_checkpoint(str(q8), progress=False, keep_blocks=True)
        with building_share(share):
            return Qwen3MoeForCausalLM({}, BuildContext(hf_config=ck.config, weights=ck.weights,
                                                        weight_format=AutoFormat({}, BuildContext(kernels=table))))
    with kernels.using(table):
        whole, ranks = model(), [model(ExpertShare(r, 2, 2)) for r in range(2)]
        for r, m in enumerate(ranks):
            m.shard(r, 2, lambda t: t, 2)
        x = paddle.to_tensor(np.random.default_rng(3).standard_normal((9, 64)).astype(np.float32))
        for i in whole.moe.moe_layers:
            parts = [m.layers[i].mlp for m in ranks]
            got = sum(part(x).numpy() for part in parts)
            np.testing.assert_allclose(got, whole.layers[i].mlp(x).numpy(), atol=1e-5, rtol=0)
            block = whole.layers[i].mlp
            for part in parts:
                assert len(part.w_down) == E // 2 and {w.q.kind for w in part.w_gate_up + part.w_down} == {"q8_0"}
                assert part._stacks not in (None, False) and part._stacks[0].num_experts == E // 2
                assert 2 * weight_bytes(part.w_gate_up + part.w_down)["q8_0"] == \
                    weight_bytes(block.w_gate_up + block.w_down)["q8_0"]


def _config_only(folder, out, **changes):
    """The checkpoint with its config.json changed (the weights linked, for
    their names): the engine checks the ranks' split from the config alone,
    before any worker starts, so these never reach a load."""
    import json
    out.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (out / name).symlink_to(folder / name)
    cfg = {**json.loads((folder / "config.json").read_text()), **changes}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_expert_parallel_keys_and_bad_combinations(folder, tmp_path):
    import argparse

    from fdx import LLM
    from fdx.entrypoints.engine_args import _add_engine_args, _overrides
    p = argparse.ArgumentParser()
    _add_engine_args(p)
    parsed = FdxConfig.build(**_overrides(p.parse_args(["-tp", "4", "--enable-expert-parallel"]))).parallel
    assert (parsed.tensor_parallel_size, parsed.expert_parallel_size) == (4, 4)     # vLLM's: EP over the TP ranks
    assert FdxConfig.build(**{"parallel.tensor_parallel_size": 4, "expert_parallel_size": 2}) \
        .parallel.expert_parallel_size == 2
    with pytest.raises(ConfigError, match=r"^config key 'parallel.expert_parallel_size': 3 does not divide"):
        FdxConfig.build(tensor_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ConfigError, match=r"^config key 'parallel.expert_parallel_size': 2 does not divide"):
        FdxConfig.build(expert_parallel_size=2)
    with pytest.raises(ConfigError, match=r"^config key 'parallel.enable_expert_parallel'"):
        FdxConfig.build(enable_expert_parallel=True)
    kw = dict(max_model_len=32, num_kv_blocks=8, progress=False)
    dense = _config_only(folder, tmp_path / "dense", architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    with pytest.raises(ConfigError, match=r"^config key 'parallel.expert_parallel_size': 2: .*no mixture-of-experts"):
        LLM(str(dense), tensor_parallel_size=2, expert_parallel_size=2, **kw)
    six = _config_only(folder, tmp_path / "six", num_experts=6)
    with pytest.raises(ConfigError, match=r"^config key 'parallel.expert_parallel_size': .*num_experts=6 does not "
                                          r"divide by 4"):
        LLM(str(six), tensor_parallel_size=4, expert_parallel_size=4, **kw)
    narrow = _config_only(folder, tmp_path / "narrow", moe_intermediate_size=30)
    with pytest.raises(ConfigError, match=r"^config key 'parallel.tensor_parallel_size': .*moe_intermediate_size=30 "
                                          r"does not divide by 4"):
        LLM(str(narrow), tensor_parallel_size=4, **kw)


# --- through the engine: worker processes -----------------------------------------------------------

PROMPTS = [np.random.default_rng(s).integers(3, 300, n).tolist() for s, n in ((5, 11), (6, 3), (7, 7))]


def _generate(folder, **kw) -> tuple[list, list, tuple[int, int]]:
    """(greedy tokens per prompt, [(tokens, expert_load)] per step, (free, total) KV blocks at the end)."""
    from fdx import LLM, SamplingParams
    from fdx.core.hookspecs import hookimpl

    class Observer:
        def __init__(self):
            self.steps = []

        @hookimpl
        def fdx_step_finished(self, scheduler_output, step_stats):
            self.steps.append((step_stats.num_scheduled_tokens, step_stats.expert_load))

    obs = Observer()
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=24,
              block_size=4, quantization="none", progress=False, **kw)
    try:
        llm.engine.plugins.pm.register(obs)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        kv = llm.engine.kv_cache
        return [o.outputs[0].token_ids for o in outs], obs.steps, (kv.num_free_blocks, kv.num_blocks)
    finally:
        llm.engine.plugins.pm.unregister(obs)
        llm.close()


@pytest.fixture(scope="module")
def one_rank(folder):
    return _generate(folder)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 2), (4, 2)], ids=["ep2", "tp4xep2"])
def test_expert_parallel_equals_one_rank(folder, one_rank, tp, ep):
    """EP 2 (two ranks, four experts each, attention split in two) and TP 4 x
    EP 2 (four ranks: two groups of four experts, each expert's columns over
    the group's two ranks; attention split in four) give one rank's greedy
    tokens; each step's expert load comes back from rank 0 and is one rank's
    (chunked prefill: 8-token steps, then decode); every KV block is free."""
    tokens, steps, (free, total) = _generate(folder, tensor_parallel_size=tp, expert_parallel_size=ep)
    want_tokens, want_steps, _ = one_rank
    assert tokens == want_tokens
    ran = [s for s in steps if s[0]]
    assert ran == [s for s in want_steps if s[0]] and len(ran) > 4 and any(n == 8 for n, _ in ran)
    assert all(len(load) == 2 and all(sum(layer) == n * K for layer in load) for n, load in ran)
    assert free == total
