"""The plugin manager: built-ins, entry points, clashes, broken and disabled plugins; every hook
documented and implemented from outside."""
from __future__ import annotations

import pathlib
import re
import sys
import types

import pytest

from fdx.core.hookspecs import hookimpl
from fdx.core.plugins import BUILTIN_PLUGINS, PluginError, PluginManager

PLUGINS_DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "plugins.md"


def _module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def test_builtins_register_every_reference_name():
    pm = PluginManager(load_entry_points=False)
    assert not pm.errors, pm.errors
    assert "v1" in pm.names("kv_scheduler")
    assert "paged" in pm.names("kv_cache")
    assert {"cpu", "cuda", "iluvatar"} <= set(pm.names("backend"))
    assert "default" in pm.names("token_processor")
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM"} <= set(pm.names("model"))
    assert {"penalties", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words"} <= set(pm.names("logits_processor"))
    assert {"fcfs", "priority", "lpm"} <= set(pm.names("queue_policy"))
    assert {"newest", "least-computed"} <= set(pm.names("preemption_policy"))
    assert {"cpu", "paddle"} <= set(pm.names("attention_backend"))
    assert "swap" in pm.names("connector") and "host" in pm.names("sampler") and "default" in pm.names("model_runner")
    assert set(pm.names("weight_format")) == {"none", "auto", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "wint8", "wint4"}


def test_unknown_name_lists_what_exists():
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(PluginError, match="no kv_scheduler named 'nope'.*v1"):
        pm.get("kv_scheduler", "nope")


def test_name_registered_twice_names_both_plugins():
    @hookimpl
    def fdx_register_kv_caches(register):
        register("paged", object)
    _module("fdx_test_clash", fdx_register_kv_caches=fdx_register_kv_caches)
    with pytest.raises(PluginError, match="'paged' is registered twice.*fdx.plugins.cache.paged.*fdx_test_clash"):
        PluginManager(builtins=BUILTIN_PLUGINS + ("fdx_test_clash",), load_entry_points=False)


def test_broken_plugin_is_reported_not_fatal():
    @hookimpl
    def fdx_register_models(register):
        raise RuntimeError("boom")
    _module("fdx_test_broken", fdx_register_models=fdx_register_models)
    pm = PluginManager(builtins=BUILTIN_PLUGINS + ("fdx_test_broken", "fdx_test_missing_module"),
                       load_entry_points=False)
    assert "boom" in pm.errors["fdx_test_broken"]
    assert "failed to load" in pm.errors["fdx_test_missing_module"]
    assert "LlamaForCausalLM" in pm.names("model")          # the rest still works
    assert "fdx_test_broken" in pm.report()


def test_disabled_plugins_env(monkeypatch):
    monkeypatch.setenv("FDX_DISABLED_PLUGINS", "fdx.plugins.backends.iluvatar, cuda")
    pm = PluginManager(load_entry_points=False)
    assert "iluvatar" not in pm.names("backend")
    assert "cuda" not in pm.names("backend")
    assert "cpu" in pm.names("backend")


def test_disabled_by_the_distribution_name_fdx_plugins_shows(example_plugin_installed):
    """The name in brackets in ``fdx plugins`` disables that distribution's
    every entry point, however it is spelled (PEP 503)."""
    shown = PluginManager().registries["kv_scheduler"]["example-fifo"].package
    assert f"[{shown}]" in PluginManager().report()
    for name in (shown, shown.upper().replace("-", "_")):
        pm = PluginManager(disabled=[name])
        assert "example-fifo" not in pm.names("kv_scheduler")
        assert "example_choice" not in pm.names("guided_backend")
        import importlib.metadata
        declared = {ep.name for ep in importlib.metadata.distribution(shown).entry_points if ep.group == "fdx"}
        assert {"example", "example_guided"} <= declared        # tests/plugin_pkg/pyproject.toml's
        assert {ep.name: (ep.status, ep.matched) for ep in pm.entry_points if ep.package == shown} == {
            n: ("disabled", name) for n in declared}
        assert "match nothing" not in pm.report()


def test_a_disabled_name_that_matches_nothing_is_a_warning(caplog, example_plugin_installed):
    with caplog.at_level("WARNING", logger="fdx.plugins"):
        pm = PluginManager(disabled=["fdx-exampel-plugin", "cuda"])
    warned = [r.getMessage() for r in caplog.records if "matches no plugin" in r.getMessage()]
    assert warned == ["FDX_DISABLED_PLUGINS names 'fdx-exampel-plugin', which matches no plugin, entry point "
                      "or distribution"]
    assert "example-fifo" in pm.names("kv_scheduler") and "cuda" not in pm.names("backend")
    assert "names in FDX_DISABLED_PLUGINS that match nothing: fdx-exampel-plugin" in pm.report()


def test_loading_is_idempotent():
    pm = PluginManager(load_entry_points=False)
    pm._load("fdx.plugins.cache.paged", lambda: __import__("fdx.plugins.cache.paged"), "fdx")
    assert len([p for p in pm.pm.get_plugins() if pm.pm.get_name(p) == "fdx.plugins.cache.paged"]) == 1


def test_entry_point_plugin_is_found(example_plugin_installed):
    pm = PluginManager()
    reg = pm.registries["kv_scheduler"]["example-fifo"]
    assert reg.plugin == "example" and reg.package == "fdx-example-plugin"
    assert "example-fifo" in pm.report() and "fdx-example-plugin" in pm.report()


def test_fdx_plugins_cli_lists_hooks(example_plugin_installed):
    import subprocess
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "plugins"], capture_output=True, text=True, check=True).stdout
    assert "fdx_register_kv_schedulers:" in out
    assert "v1" in out and "example-fifo" in out and "[fdx-example-plugin]" in out
    # the built-in expert-load tap (plugins/models/moe_taps.py) observes every step first
    assert "fdx_step_finished: fdx.plugins.models.moe_taps, example" in out


def test_every_hook_is_documented():
    import pathlib

    from fdx.core import hookspecs
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    hooks = [n for n in dir(hookspecs) if n.startswith("fdx_")]
    assert len(hooks) == 29                 # 27, and the two deprecated names (issue 36 item 3)
    missing = [h for h in hooks if f"`{h}" not in doc]
    assert not missing, missing


def test_every_hook_has_a_section_and_an_outside_implementation_a_test_runs(example_plugin_installed):
    """datasette's rule: every hook spec in core/hookspecs.py has a section
    of this page (a ``###`` heading naming it in backticks) and an
    implementation in tests/plugin_pkg (the outside package, installed with
    pip); every name a registration hook of that package registers is
    selected by some test (quoted in a tests/test_*.py other than this one),
    so each outside implementation runs end to end."""
    from fdx.core import hookspecs
    from fdx.core.plugins import DEPRECATED_HOOKS, KINDS, PluginManager
    hooks = sorted(n for n in dir(hookspecs) if n.startswith("fdx_"))
    headings = [line for line in PLUGINS_DOC.read_text().splitlines() if line.startswith("### ")]
    undocumented = [h for h in hooks if not any(f"`{h}`" in line for line in headings)]
    pm = PluginManager()
    hooks = [h for h in hooks if h not in DEPRECATED_HOOKS]       # documented above, implemented by none
    outside = [h for h in hooks if any(getattr(impl.plugin, "__name__", "").startswith("fdx_example_plugin")
                                       for impl in getattr(pm.pm.hook, h).get_hookimpls())]
    not_outside = [h for h in hooks if h not in outside]
    tests = "".join(p.read_text() for p in PLUGINS_DOC.parent.parent.glob("tests/test_*.py") if p.name != "test_plugins.py")
    untested = [(h, kind) for h, kind in KINDS.items() if h in outside and not any(
        f'"{name}"' in tests for name, reg in pm.registries[kind].items() if reg.package == "fdx-example-plugin")]
    assert not undocumented and not not_outside and not untested, (undocumented, not_outside, untested)


def _two_entry_point_dist(site) -> None:
    """A throwaway distribution ``Evil-Dist`` (written by hand as a
    dist-info) with two entry points into one package, whose ``__init__``
    writes the file named by $EVIL_MARKER when imported."""
    pkg = site / "evil_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os, pathlib\npathlib.Path(os.environ['EVIL_MARKER']).write_text('imported')\n")
    (pkg / "one.py").write_text("")
    (pkg / "two.py").write_text("")
    info = site / "Evil_Dist-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: Evil-Dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fdx]\nevil = evil_pkg.one\nevil-sibling = evil_pkg.two\n")


def _fdx_plugins(site, marker, disabled: str):
    import os
    import subprocess
    env = {**os.environ, "EVIL_MARKER": str(marker), "FDX_DISABLED_PLUGINS": disabled,
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "plugins"], capture_output=True,
                          text=True, env=env, check=True, timeout=300)


@pytest.mark.slow
def test_a_distribution_disabled_by_name_imports_nothing(tmp_path):
    site, marker = tmp_path / "site", tmp_path / "imported"
    _two_entry_point_dist(site)

    out = _fdx_plugins(site, marker, "evil_dist, no-such-plugin")        # PEP 503: evil_dist == Evil-Dist
    assert not marker.exists(), "the disabled distribution's package was imported"
    lines = [line.split() for line in out.stdout.splitlines()]
    assert ["evil", "evil_pkg.one", "[Evil-Dist]", "disabled", "(by", "FDX_DISABLED_PLUGINS", "name", "'evil_dist')"] in lines
    assert ["evil-sibling", "evil_pkg.two", "[Evil-Dist]", "disabled", "(by", "FDX_DISABLED_PLUGINS", "name", "'evil_dist')"] in lines
    assert "'no-such-plugin', which matches no plugin" in out.stderr

    _fdx_plugins(site, marker, "")                   # enabled, the same package is imported
    assert marker.read_text() == "imported"


def test_kinds_built_outside_the_assembly_get_their_validated_settings():
    """A weight format, a MoE router and a chat parser that declare
    ``Settings`` are built with the validated instance (not the raw dict),
    and a bad value is a ConfigError naming the full key."""
    from dataclasses import dataclass

    from fdx.core.chat_output import chat_parser
    from fdx.model_io.model import weight_format
    from fdx.core.config import ConfigError, FdxConfig
    from fdx.core.interfaces import ToolParser, ToolParseResult, WeightFormat

    @dataclass
    class Bits:
        bits: int = 8

    class MyFormat(WeightFormat):
        Settings = Bits

        def load(self, name, tensor, role):
            return tensor

    class MyTools(ToolParser):
        Settings = Bits

        def extract(self, text):
            return ToolParseResult(text, [])

    class Plugin:
        @hookimpl
        def fdx_register_weight_formats(self, register):
            register("settings-format", MyFormat)

        @hookimpl
        def fdx_register_tool_parsers(self, register):
            register("settings-tools", MyTools)

    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Plugin(), name="settings-plugin")
    cfg = FdxConfig.build(quantization="settings-format", tool_call_parser="settings-tools",
                          **{"plugins.weight_format.settings-format": {"bits": 4},
                             "plugins.tool_parser.settings-tools": {"bits": 2}})
    assert weight_format(cfg, pm).settings == Bits(4)
    parser = chat_parser(pm, cfg, "tool_parser", "tool_call_parser")
    assert parser.cls is MyTools and parser.settings == Bits(2)
    bad = FdxConfig.build(quantization="settings-format", **{"plugins.weight_format.settings-format": {"bitz": 4}})
    with pytest.raises(ConfigError, match="plugins.weight_format.settings-format.bitz"):
        weight_format(bad, pm)


def test_the_old_scheduler_names_are_aliases_with_a_warning(caplog, monkeypatch):
    """Issue 36 item 3: a plugin on the old hook name registers into the new
    kind (one warning naming the plugin and the new hook), the old kind
    names find the new registries, and settings under the old kind move to
    the new one (one warning), where the assembly validates them."""
    from fdx.core import config as config_mod
    from fdx.core.assembly import Assembly
    from fdx.core.config import ConfigError, FdxConfig
    from fdx.core.interfaces import KVScheduler, RequestScheduler, SchedulerPolicy

    class Old(SchedulerPolicy):
        def schedule(self, core):
            core.schedule_running()

    class OldRequests(RequestScheduler):
        def add(self, request_id, prompt_token_ids, params, callback, trace=None):
            pass

        def abort(self, request_ids):
            pass

    class Plugin:
        @hookimpl
        def fdx_register_resource_managers(self, register):
            register("old-hook", Old)

        @hookimpl
        def fdx_register_schedulers(self, register):
            register("old-requests", OldRequests)

    assert SchedulerPolicy is KVScheduler
    pm = PluginManager(load_entry_points=False)
    with caplog.at_level("WARNING", logger="fdx.plugins"):
        pm.add_plugin(Plugin(), name="old-names")
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert warned == ["plugin 'old-names' implements fdx_register_resource_managers, which is deprecated: rename "
                      "it fdx_register_kv_schedulers (docs/plugins.md)",
                      "plugin 'old-names' implements fdx_register_schedulers, which is deprecated: rename it "
                      "fdx_register_request_schedulers (docs/plugins.md)"]
    assert pm.get("kv_scheduler", "old-hook") is Old and pm.get("resource_manager", "old-hook") is Old
    assert pm.get("request_scheduler", "old-requests") is OldRequests
    assert pm.names("scheduler") == pm.names("request_scheduler") and {"local", "global"} <= set(pm.names("scheduler"))

    monkeypatch.setattr(config_mod, "_warned", set())
    caplog.clear()
    with caplog.at_level("WARNING", logger="fdx.config"):
        cfg = FdxConfig.build(kv_scheduler="v0", **{"plugins.resource_manager.v0": {"kv_cache_ratio": 0.5},
                                                    "plugins": {"scheduler": {"global": {"ttl_s": 3}}}})
    assert cfg.plugins == {"kv_scheduler": {"v0": {"kv_cache_ratio": 0.5}}, "request_scheduler": {"global": {"ttl_s": 3}}}
    assert sorted(r.getMessage() for r in caplog.records) == [
        "config key 'plugins.resource_manager' is deprecated: use 'plugins.kv_scheduler' (docs/configuration.md)",
        "config key 'plugins.scheduler' is deprecated: use 'plugins.request_scheduler' (docs/configuration.md)"]
    assert Assembly(cfg, pm).settings("kv_scheduler", "v0").kv_cache_ratio == 0.5
    with pytest.raises(ConfigError, match="plugins.kv_scheduler.v0.kv_cache_ratio"):
        Assembly(FdxConfig.build(kv_scheduler="v0", **{"plugins.resource_manager.v0": {"kv_cache_ratio": 2}}), pm)


def test_make_plugin_one_shape_an_adapter_for_the_old_ones_and_errors_naming_the_key():
    """Issue 36 item 2: ``make_plugin`` calls a ``(settings, context)`` class
    so, with its validated settings and the context; an outside class in
    its kind's older shape through the adapter, with a DeprecationWarning
    naming it (a built-in one too: fdx's are all in the one shape), and a
    subclass calling its base's constructor in the older shape gets it
    mapped, with a warning; an unknown name is a ConfigError
    naming the selecting key, a bad setting one naming
    ``plugins.<kind>.<name>.<key>``, a constructor's ValueError one naming
    ``plugins.<kind>.<name>``."""
    import warnings
    from dataclasses import dataclass

    from fdx.core.config import ConfigError, FdxConfig
    from fdx.core.interfaces import BuildContext, LoRALoader, Proposer
    from fdx.core.plugins import get_plugin_manager, make_plugin, new_shape

    @dataclass
    class Limit:
        limit: int = 3

    class NewProposer(Proposer):
        Settings = Limit

        def __init__(self, settings, context):
            if settings.limit < 1:
                raise ValueError("limit must be >= 1")
            super().__init__(settings, context)

        def propose(self, request_id, token_ids, k, hidden_states=None):
            return list(token_ids[-self.settings.limit:])[:k]

    class OldProposer(NewProposer):
        def __init__(self, config, vocab_size, settings=None):
            Proposer.__init__(self, config, vocab_size, settings)

    class Loader(LoRALoader):                    # the base's (settings=None, context=None): the new shape
        def load(self, path):
            return None

    class Plugin:
        @hookimpl
        def fdx_register_proposers(self, register):
            register("new-p", NewProposer)
            register("old-p", OldProposer)

        @hookimpl
        def fdx_register_lora_loaders(self, register):
            register("my-loader", Loader)
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Plugin(), name="shapes")
    assert new_shape(NewProposer) and new_shape(Loader) and not new_shape(OldProposer)
    cfg = FdxConfig.build(**{"plugins.proposer.new-p": {"limit": 2}})

    def make(name, config=cfg, kind="proposer"):
        return make_plugin(BuildContext(config, pm, kind, name, vocab_size=99), "speculative.method")
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the new shape warns of nothing
        p = make("new-p")
        assert make("my-loader", kind="lora_loader").settings == {}
    assert (p.settings, p.vocab_size, p.config) == (Limit(2), 99, cfg)
    assert p.propose("r", [1, 2, 3, 4], 4) == [3, 4]
    with pytest.warns(DeprecationWarning) as seen:
        old = make("old-p")
    assert (old.settings, old.vocab_size, old.config) == (Limit(), 99, cfg)
    said = [str(w.message) for w in seen]
    assert any(re.search(r"proposer 'old-p' .*OldProposer.* older per-kind shape", m) for m in said), said
    assert any(re.search(r"OldProposer calls its base class's constructor in the older proposer shape", m)
               for m in said), said
    with warnings.catch_warnings():              # the built-ins are in the one shape: no warning
        warnings.simplefilter("error")
        make_plugin(BuildContext(cfg, get_plugin_manager(), "proposer", "ngram", vocab_size=99), "speculative.method")

    class Builtin:                               # a plugin shipped as fdx's own, in an older shape: it warns
        @hookimpl
        def fdx_register_proposers(self, register):
            register("old-builtin", OldProposer)
    pm.add_plugin(Builtin(), name="fdx.plugins.spec.old", package="fdx")
    assert "old-builtin" in pm.builtin_names("proposer")
    with pytest.warns(DeprecationWarning) as seen:
        make("old-builtin")
    assert any(re.search(r"proposer 'old-builtin' .*OldProposer.* older per-kind shape", str(w.message))
               for w in seen)
    with pytest.raises(ConfigError, match=r"config key 'speculative.method': .*no-such"):
        make("no-such")
    with pytest.raises(ConfigError, match=r"plugins\.proposer\.new-p\.limit"):
        make("new-p", FdxConfig.build(**{"plugins.proposer.new-p": {"limit": "x"}}))
    with pytest.raises(ConfigError, match=r"config key 'plugins\.proposer\.new-p': limit must be >= 1"):
        make("new-p", FdxConfig.build(**{"plugins.proposer.new-p": {"limit": 0}}))


def test_every_builtin_of_every_kind_and_every_base_class_takes_settings_and_context():
    """Issue 36 item 2: every class fdx's own plugins register, of every
    kind (activation functions are functions, not constructed), and every
    base class in fdx.core.interfaces a plugin inherits its constructor
    from, is constructed as ``cls(settings, context)``; the executors too."""
    from fdx.core import interfaces
    from fdx.core.executor import UniProcExecutor
    from fdx.core.plugins import KINDS, new_shape
    pm = PluginManager(load_entry_points=False)
    checked = set()
    for kind in KINDS.values():
        if kind == "activation_function":
            continue
        for name in pm.builtin_names(kind):
            cls = pm.get(kind, name)
            assert new_shape(cls), (kind, name, cls)
            checked.add(kind)
    assert checked == set(KINDS.values()) - {"activation_function", "admission_rule", "moe_router"}
    bases = [interfaces.KVScheduler, interfaces.QueuePolicy, interfaces.AdmissionRule, interfaces.PreemptionPolicy,
             interfaces.RequestScheduler, interfaces.KVCacheManager, interfaces.KVConnector,
             interfaces.TokenProcessor, interfaces.LogitsProcessor, interfaces.GuidedBackend, interfaces.Backend,
             interfaces.AttentionBackend, interfaces.Sampler, interfaces.ModelRunner, interfaces.WeightFormat,
             interfaces.LoRALoader, interfaces.Proposer, interfaces.ToolParser, interfaces.ReasoningParser,
             interfaces.Observer, UniProcExecutor]
    assert [b.__name__ for b in bases if not new_shape(b)] == []


def test_a_base_class_maps_its_older_constructor_call_with_a_warning():
    """A subclass written to the old docs calls its base's constructor in
    the kind's older shape, by position or with keywords: the base maps it
    onto ``(settings, context)`` with a DeprecationWarning naming the
    class; the one shape, by position or by name (or nothing, for a part
    built by hand), warns of nothing; an argument the older shape never
    had is a TypeError."""
    import warnings

    from fdx.core.config import FdxConfig
    from fdx.core.interfaces import BuildContext, KVCacheManager, KVScheduler, ModelRunner, RunnerContext
    cfg = FdxConfig.build()

    class Policy(KVScheduler):
        def schedule(self, core):
            pass

    class Blocks(KVCacheManager):
        def __init__(self, num_blocks, block_size, config=None, settings=None):
            super().__init__(num_blocks, block_size, config, settings=settings)
        allocate_slots = free = block_table = num_free_blocks = None

    class Runner(ModelRunner):
        def execute(self, scheduler_output):
            pass
    rc = RunnerContext(cfg, None, [], None, None, None, [], frozenset())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for p in (Policy({"x": 1}, BuildContext(cfg)), Policy(settings={"x": 1}, context=BuildContext(cfg)),
                  Policy({"x": 1}, context=BuildContext(cfg))):
            assert (p.config, p.settings) == (cfg, {"x": 1})
        assert (Policy().config, Policy().settings) == (None, {})
        assert Runner({}, BuildContext(cfg, runner=rc)).ctx is rc
    for build, want in [(lambda: Policy(cfg), (cfg, {})), (lambda: Policy(cfg, {"y": 2}), (cfg, {"y": 2})),
                        (lambda: Policy(cfg, settings={"y": 2}), (cfg, {"y": 2})),
                        (lambda: Policy(config=cfg, settings={"y": 2}), (cfg, {"y": 2}))]:
        with pytest.warns(DeprecationWarning, match="Policy calls its base class's constructor in the older "
                                                    "kv_scheduler shape"):
            p = build()
        assert (p.config, p.settings) == want
    with pytest.warns(DeprecationWarning, match="older kv_cache shape"):
        b = Blocks(8, 4, cfg, {"z": 3})
    assert (b.num_blocks, b.block_size, b.config, b.settings) == (8, 4, cfg, {"z": 3})
    with pytest.warns(DeprecationWarning, match="older model_runner shape"):
        assert Runner(rc).ctx is rc
    with pytest.raises(TypeError, match="takes \\(settings, context\\), not 'bogus'"):
        Policy(cfg, bogus=1)
    with pytest.raises(TypeError, match="kv_scheduler base class takes"):
        Policy(cfg, {}, 3)


def test_an_observer_is_called_only_for_the_hooks_it_overrides():
    """``Observer`` declares the four observer hooks with defaults; the
    engine calls only those a class overrides (``observes``), never reads
    them with getattr, and refuses a registered observer that is no
    ``Observer``."""
    from fdx.core.assembly import Assembly
    from fdx.core.config import ConfigError, FdxConfig
    from fdx.core.interfaces import Observer

    seen = []

    class Finished(Observer):                    # one hook; Observer's own constructor
        def fdx_request_finished(self, request):
            seen.append(request)

    class NotAnObserver:
        def __init__(self, config, settings=None):
            pass

    class Plugin:
        @hookimpl
        def fdx_register_observers(self, register):
            register("finished-only", Finished)
            register("not-an-observer", NotAnObserver)
    pm = PluginManager(load_entry_points=False)
    pm.add_plugin(Plugin(), name="observers")
    (obs,) = Assembly(FdxConfig.build(observers=["finished-only"]), pm).observers()
    assert obs.name == "finished-only"
    assert obs.observes("fdx_request_finished") and not obs.observes("fdx_step_finished")
    assert pm.has_observers("fdx_request_finished", [obs])
    pm.notify("fdx_step_finished", [obs], scheduler_output=None, step_stats=None, context=None)
    pm.notify("fdx_request_finished", [obs], request="r1", output=None)
    assert seen == ["r1"]
    with pytest.raises(ConfigError, match=r"observability\.observers.*not-an-observer.*does not subclass"):
        Assembly(FdxConfig.build(observers=["not-an-observer"]), pm).observers()
