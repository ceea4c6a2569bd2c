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


# -- plugin settings moved out of the core (issue 19): the old keys are aliases for one release

OLD_TO_NEW = [   # (old key as given, value, the new place, the plugin it also selects: (key, name))
    (dict(swap_dir="/tmp/t"), ("connector", "swap", "dir", "/tmp/t"), ("cache", "kv_connector", "swap")),
    ({"cache.swap_max_blocks": 8}, ("connector", "swap", "max_blocks", 8), ("cache", "kv_connector", "swap")),
    (dict(swap_max_blocks=0), ("connector", "swap", "max_blocks", 0), ("cache", "kv_connector", None)),
    (dict(kv_cache_ratio=0.5), ("kv_scheduler", "v0", "kv_cache_ratio", 0.5), None),
    (dict(splitwise_role="decode"), ("connector", "splitwise", "role", "decode"),
     ("cache", "kv_connector", "splitwise")),
    (dict(splitwise={"connector_port": 9, "role": "prefill"}), ("connector", "splitwise", "port", 9),
     ("cache", "kv_connector", "splitwise")),
    (dict(debug_transfer_delay_s=1.5), ("connector", "splitwise", "debug_transfer_delay_s", 1.5), None),
    (dict(cuda_graph=True), None, ("backend", "model_runner", "cuda-graph")),
    (dict(cuda_graph=False), None, ("backend", "model_runner", None)),
    ({"backend.cuda_graph_batch_sizes": [1, 2]}, ("model_runner", "cuda-graph", "batch_sizes", [1, 2]), None),
    # names (issue 36 item 3): the KV scheduler's key
    (dict(resource_manager="v0"), None, ("scheduler", "kv_scheduler", "v0")),
    (dict(scheduler={"resource_manager": "v0"}), None, ("scheduler", "kv_scheduler", "v0")),
]


@pytest.mark.parametrize("old,new,selects", OLD_TO_NEW)
def test_old_plugin_keys_map_to_the_plugin_settings_with_a_warning(old, new, selects, caplog, monkeypatch):
    from fdx.core import config as config_mod
    monkeypatch.setattr(config_mod, "_warned", set())
    with caplog.at_level("WARNING", logger="fdx.config"):
        cfg = FdxConfig.build(**old)
    kind, name, key, value = new or (None, None, None, None)
    if new:
        assert cfg.plugins[kind][name][key] == value
    if selects:
        section, field, plugin = selects
        assert getattr(getattr(cfg, section), field) == plugin
    warned = [r.getMessage() for r in caplog.records]       # one line each, naming the old key and the new
    assert warned and all("\n" not in w and any(f"'{k}' is deprecated: use '{v}'" in w
                                                for k, v in config_mod.DEPRECATED.items()) for w in warned), warned


def test_an_explicit_selector_wins_over_what_an_old_key_implied():
    cfg = FdxConfig.build(swap_dir="/tmp/t", kv_connector="example-memory")
    assert cfg.cache.kv_connector == "example-memory" and cfg.plugins["connector"]["swap"] == {"dir": "/tmp/t"}
    both = FdxConfig.build(swap_max_blocks=4, splitwise_role="prefill")     # as before: splitwise first
    assert both.cache.kv_connector == "splitwise"


def test_old_keys_and_new_plugin_settings_of_one_plugin_merge():
    """An old key (an alias into plugins.connector.splitwise) beside new
    settings for the same plugin: both hold, in either order (the plugins
    mapping used to replace what the alias had put there)."""
    new = {"plugins": {"connector": {"splitwise": {"transfer_timeout_s": 7.0}}}}
    for kwargs in ({"splitwise": {"role": "decode", "connector_port": 9123}, **new},
                   {**new, "splitwise": {"role": "decode", "connector_port": 9123}}):
        cfg = FdxConfig.build(**kwargs)
        assert cfg.plugins["connector"]["splitwise"] == {"role": "decode", "port": 9123, "transfer_timeout_s": 7.0}
        assert cfg.cache.kv_connector == "splitwise"


def test_the_core_config_has_no_plugin_settings_left():
    fields = {f"{s}.{f}" for s in ("cache", "backend") for f in type(getattr(FdxConfig(), s)).model_fields}
    assert not fields & {"cache.swap_dir", "cache.swap_max_blocks", "cache.kv_cache_ratio", "backend.cuda_graph",
                         "backend.cuda_graph_batch_sizes"}
    assert "splitwise" not in FdxConfig.model_fields
    with pytest.raises(ConfigError, match=r"unknown config key 'splitwise\.bogus'"):
        FdxConfig.build(**{"splitwise.bogus": 1})


def test_plugin_settings_schemas_name_the_full_key():
    """The built-ins' schemas, through the assembly (where the engine validates them, once)."""
    from fdx.core.assembly import Assembly
    from fdx.core.plugins import get_plugin_manager
    pm = get_plugin_manager()
    cases = [
        ({"plugins.connector.splitwise": {"role": "decode"}, "kv_connector": "splitwise"},
         r"config key 'plugins\.connector\.splitwise': Value error, port must be set"),
        ({"plugins.connector.splitwise": {"role": "decode", "port": 70000}, "kv_connector": "splitwise"},
         r"config key 'plugins\.connector\.splitwise\.port': Input should be less than or equal to 65535"),
        ({"plugins.connector.swap.max_blocks": -1}, r"config key 'plugins\.connector\.swap\.max_blocks'"),
        (dict(kv_cache_ratio=1.5), r"config key 'plugins\.kv_scheduler\.v0\.kv_cache_ratio': Input should be "
                                   r"less than or equal to 1"),
        ({"plugins.resource_manager.v0.ratio": 0.5}, r"unknown config key 'plugins\.kv_scheduler\.v0\.ratio'"),
    ]
    for overrides, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            Assembly(FdxConfig.build(**overrides), pm)
    a = Assembly(FdxConfig.build(resource_manager="v0", kv_cache_ratio=0.4), pm)
    assert a.settings("resource_manager", "v0").kv_cache_ratio == 0.4
    assert a.settings("connector", "swap").max_blocks is None       # the schema's defaults, unconfigured
