from __future__ import annotations

import pytest

from fdx.core.config import ConfigError, FdxConfig


def test_flat_dotted_and_yaml(tmp_path):
    path = tmp_path / "fdx.yaml"
    path.write_text("cache:\n  block_size: 32\nscheduler:\n  max_num_seqs: 8\nseed: 7\n")
    cfg = FdxConfig.build(str(path), max_num_seqs=4, **{"cache.num_kv_blocks": 100})
    assert cfg.cache.block_size == 32
    assert cfg.scheduler.max_num_seqs == 4        # overrides beat YAML
    assert cfg.cache.num_kv_blocks == 100
    assert cfg.seed == 7


@pytest.mark.parametrize("kwargs,needle", [
    ({"blok_size": 4}, "'blok_size'"),
    ({"cache.blok": 4}, "'cache.blok'"),
    ({"nosection.x": 4}, "'nosection'"),
    ({"block_size": 0}, "'cache.block_size'"),
    ({"max_num_seqs": "many"}, "'scheduler.max_num_seqs'"),
    ({"enable_chunked_prefill": "perhaps"}, "'scheduler.enable_chunked_prefill'"),
])
def test_bad_keys_and_values_are_named(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        FdxConfig.build(**kwargs)


def test_bad_yaml_names_the_key(tmp_path):
    path = tmp_path / "fdx.yaml"
    path.write_text("scheduler:\n  max_num_seqs: -1\n")
    with pytest.raises(ConfigError, match="scheduler.max_num_seqs"):
        FdxConfig.build(str(path))
    path.write_text("cache: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        FdxConfig.build(str(path))
