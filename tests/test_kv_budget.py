"""A KV cache people can predict (issue 38 item 6): the default holds
max_num_seqs x max_model_len tokens, capped at cache.memory_fraction of the
host's total memory, so two starts of `fdx serve` with the same settings
report the same size; --kv-cache-memory-bytes sets it in bytes;
--kv-cache-ratio is v0's and refused under v1 with the reason."""
from __future__ import annotations

import re

import pytest

from fdx.core.config import ConfigError

LINE = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens = (\d+) tokens \(.*\), (\d+) bytes .*; from (.*)")


def kv_line(srv) -> tuple[int, int, int, int, str]:
    (m,) = [LINE.search(line) for line in srv.log_path.read_text().splitlines() if LINE.search(line)]
    return int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]


@pytest.mark.slow
def test_two_starts_report_the_same_kv_size_and_the_flags_change_it(tmp_path, tiny_checkpoints):
    from serve_utils import serving
    path, _ = tiny_checkpoints["LlamaForCausalLM"]
    model = {"model": str(path), "max_model_len": 256}
    bytes_per_block = 2 * 2 * 2 * 16 * 16 * 4        # k+v, 2 layers, 2 KV heads, 16 tokens, head_dim 16, fp32
    seen = []
    for i, cache in enumerate(({"num_kv_blocks": None}, {"num_kv_blocks": None},
                               {"num_kv_blocks": None, "kv_cache_memory_bytes": 40 * bytes_per_block + 5})):
        (tmp_path / str(i)).mkdir()
        with serving(tmp_path / str(i), model=model, cache=cache, scheduler={"max_num_seqs": 6},
                     server={"log_level": "info"}) as srv:
            seen.append(kv_line(srv))
            assert srv.metrics()["fdx:kv_cache_total_blocks"] == seen[-1][0]
    assert seen[0] == seen[1]                         # the same settings: the same KV cache
    blocks, block_size, tokens, nbytes, why = seen[0]
    assert (blocks, block_size, tokens) == (6 * 16, 16, 6 * 256) and nbytes == blocks * bytes_per_block
    assert why.startswith("max_num_seqs 6 x max_model_len 256")
    assert seen[2][0] == 40 and seen[2][3] == 40 * bytes_per_block and seen[2][4] == "cache.kv_cache_memory_bytes"


def test_the_flags_reach_the_config_and_kv_cache_ratio_needs_v0():
    from fdx.core.assembly import Assembly
    from fdx.entrypoints.cli import build_parser
    from fdx.core.config import FdxConfig
    from fdx.entrypoints.engine_args import _overrides
    from fdx.core.plugins import get_plugin_manager
    args = build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "1048576", "--kv-cache-ratio", "0.5"])
    cfg = FdxConfig.build(**_overrides(args))
    assert cfg.cache.kv_cache_memory_bytes == 1048576
    with pytest.raises(ConfigError, match=r"plugins\.kv_scheduler\.v0\.kv_cache_ratio.*kv_scheduler is "
                                          r"v1.*--kv-scheduler v0"):
        Assembly(cfg, get_plugin_manager())
    cfg = FdxConfig.build(**_overrides(build_parser().parse_args(
        ["serve", "--kv-cache-ratio", "0.5", "--resource-manager", "v0"])))
    assert Assembly(cfg, get_plugin_manager()).settings("resource_manager", "v0").kv_cache_ratio == 0.5
