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

from fdx.core.checkpoint.loader import load_checkpoint
from fdx.core.config import ConfigError, FdxConfig
from fdx.plugins.models.moe_config import ExpertShare, building_share
from fdx.plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from test_moe_grouped import E, K, write_qwen3_moe


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_qwen3_moe(tmp_path_factory.mktemp("moe_ep"), kv=4)


def _model(folder, share: ExpertShare | None = None) -> Qwen3MoeForCausalLM:
    ck = load_checkpoint(str(folder), progress=False)
    with building_share(share):
        return Qwen3MoeForCausalLM(ck.config, ck.weights)


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
                assert part.held == (first, end) and len(part.w_gate_up) == len(part.w_down) == E // groups
                assert part.w_gate_up[0].shape == (2 * 32 * groups // world, 64)
            got = sum(part(x).numpy() for part in parts)
            np.testing.assert_allclose(got, block(x).numpy(), atol=1e-5, rtol=0)
            assert all(np.array_equal(part.last_load, block.last_load) for part in parts)   # every rank routes all
            assert block.last_load.sum() == rows * K


def test_expert_parallel_keys_and_bad_combinations(folder, tiny_checkpoints):
    import argparse

    from fdx import LLM
    from fdx.core.engine_args import _add_engine_args, _overrides
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
    dense, _ = tiny_checkpoints["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match=r"config key 'parallel.expert_parallel_size'.*no mixture-of-experts"):
        LLM(str(dense), tensor_parallel_size=2, expert_parallel_size=2, **kw)
    # 8 experts in 4 groups, each expert's 32 columns over 2 ranks: fine; 8 groups of 8 ranks cannot split 32 / 1 ...
    with pytest.raises(ConfigError, match=r"config key 'parallel.tensor_parallel_size'.*moe_intermediate_size=32 "
                                          r"does not divide by 64"):
        LLM(str(folder), tensor_parallel_size=64, expert_parallel_size=1, **kw)
