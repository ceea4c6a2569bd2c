"""Shared fixtures. Heavy objects (the SmolLM2 engine) are built once per session."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"

# Fixtures that load SmolLM2, build torch reference models, install a package
# or start a server: a test that uses one is marked slow, so that
# `python -m pytest -m "not slow"` stays the quick subset. Tests that start a
# subprocess themselves carry @pytest.mark.slow.
SLOW_FIXTURES = {
    "smollm_llm", "smollm", "smollm_reference", "hf_smollm", "hf_smollm_model", "hf_logits",
    "tiny_checkpoints", "smollm_hf_tokenizer_dir", "example_plugin_installed", "server", "case", "ref",
    "browser", "built_wheel", "tiny_model",
}


def _direct_params(item) -> set[str]:
    """The argument names a test's own ``parametrize`` fills (not fixtures):
    test_chat_parsers' ``case`` is a recorded parser output, not
    test_models' slow ``case`` fixture."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        args = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        args = [a.strip() for a in args.split(",")] if isinstance(args, str) else list(args)
        indirect = mark.kwargs.get("indirect", False)
        if indirect is True:
            continue
        names.update(a for a in args if not (isinstance(indirect, (list, tuple)) and a in indirect))
    return names


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        compiled = isinstance(params.get("impl"), (tuple, str)) and "cpp" in str(params.get("impl"))
        fixtures = set(getattr(item, "fixturenames", ())) - _direct_params(item)
        if SLOW_FIXTURES.intersection(fixtures) or compiled:
            item.add_marker(pytest.mark.slow)


# Session fixtures that hold a SmolLM2 each (about 0.65 GB resident apiece): the modules that
# use them run first, so that both are gone (pytest_runtest_teardown below) before the rest run.
HEAVY_SESSION_FIXTURES = ("smollm_llm", "hf_smollm_model")

# Modules that took over 15 s (FDX_TEST_MEASURE, one process, tests/README.md), longest first:
# they run right after the SmolLM2 modules, so that on two processes the run ends on short
# modules, not on one of these while the other process has nothing left to do (the others
# follow in file order; test_weight_formats and test_ui, 40 s each, came last in that order).
# Measured 2026-12-05 (the shared machine: wall seconds 1.5-2x an idle one's). A name here that
# no longer exists is ignored.
LONG_MODULES = ("test_wheel.py", "test_kernel_cache.py", "test_spec.py", "test_reliability.py",
                "test_global_scheduler.py", "test_batch_invariance.py", "test_router.py", "test_pairwise_matrix.py",
                "test_weight_formats.py", "test_guided.py", "test_ui.py", "test_http_attacks.py",
                "test_kernel_table.py", "test_slow_peers.py", "test_splitwise.py", "test_edge.py", "test_shutdown.py",
                "test_serve_names.py", "test_spec_draft.py", "test_memory.py", "test_lora.py", "test_executor.py",
                "test_research.py", "test_moe_ep.py", "test_tools_server.py")


class _HeavyModulesFirst:
    @pytest.hookimpl(trylast=True)              # after pytest's reordering and -m/-k deselection
    def pytest_collection_modifyitems(self, items):
        _heavy_modules_first(items)


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _heavy_modules(items) -> set[str]:
    """The modules that use a fixture of HEAVY_SESSION_FIXTURES (by name,
    through another fixture, or ``getfixturevalue("name")`` in their source)."""
    heavy: set[str] = set()
    seen: set[str] = set()
    for item in items:
        module = _module(item)
        if module in heavy:
            continue
        uses = bool(set(HEAVY_SESSION_FIXTURES) & set(getattr(item, "fixturenames", ())))
        if module not in seen and not uses:
            try:
                text = item.path.read_text()
            except (OSError, AttributeError):
                text = ""
            uses = any(f'getfixturevalue("{n}")' in text for n in HEAVY_SESSION_FIXTURES)
        seen.add(module)
        if uses:
            heavy.add(module)
    return heavy


def _heavy_modules_first(items) -> None:
    """Modules that use a fixture of HEAVY_SESSION_FIXTURES first (in their
    collected order), then LONG_MODULES, then the others; each module's items
    keep their order and stay together."""
    heavy = _heavy_modules(items)

    def rank(item) -> int:
        module = _module(item)
        if module in heavy:
            return 0
        name = module.rsplit("/", 1)[-1]
        return 1 + LONG_MODULES.index(name) if name in LONG_MODULES else 1 + len(LONG_MODULES)
    items.sort(key=rank)


# -- two processes (pytest-xdist) ----------------------------------------------------------
#
# `python -m pytest` runs on two processes when pytest-xdist is installed (the test extra has
# it), each module on one process; the modules that use the session's SmolLM2 (_heavy_modules)
# run on one process as one unit, so that only one process ever holds it. -n N sets how many,
# -n 0 or -p no:xdist runs in this process, and a run of one file (or --pdb) stays here too.

WORKERS = 2
_OURS = pytest.StashKey[bool]()                  # this run's distribution is ours (ModuleScheduling)
_UNITS_DIR = pytest.StashKey[str]()


def _one_file(args) -> bool:
    files = {a.split("::")[0] for a in args}
    return len(files) == 1 and os.path.isfile(next(iter(files)))


@pytest.hookimpl(tryfirst=True)                  # before xdist's, which reads these options
def pytest_cmdline_main(config):
    opt = config.option
    if not hasattr(opt, "numprocesses") or hasattr(config, "workerinput"):
        return                                   # no xdist (or -p no:xdist), or a worker
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if (opt.numprocesses is None and opt.dist == "no" and not opt.tx and cores >= WORKERS
            and not (opt.usepdb or opt.collectonly or _one_file(config.args))):
        opt.numprocesses = WORKERS
    if opt.numprocesses and opt.dist == "no" and not opt.tx:
        opt.dist = "load"                        # what xdist would set; the scheduler is ours
        if isinstance(opt.numprocesses, int):    # (not "auto"): xdist's hook may have run first (-p conftest)
            opt.tx = ["popen"] * opt.numprocesses
        opt.loadscopereorder = False             # units in the collected order (_heavy_modules_first)
        config.stash[_OURS] = True
        config.pluginmanager.register(_Distribution(), "fdx-distribution")


class _Distribution:
    """xdist's hooks (registered by pytest_cmdline_main when the distribution
    is ours: a conftest's hooks must all be known, and these are not
    without xdist)."""

    def pytest_configure_node(self, node):
        """(In the controller) Where a worker writes the units that
        ModuleScheduling reads: a folder of this run."""
        import tempfile
        folder = node.config.stash.get(_UNITS_DIR, None)
        if folder is None:
            folder = node.config.stash[_UNITS_DIR] = tempfile.mkdtemp(prefix="fdx-xdist-")
        node.workerinput["fdx_units"] = folder

    def pytest_xdist_make_scheduler(self, config, log):
        return _module_scheduling(config, log)

    def pytest_unconfigure(self, config):
        import shutil
        shutil.rmtree(config.stash.get(_UNITS_DIR, ""), ignore_errors=True)


def _module_scheduling(config, log):
    """xdist's load-by-scope scheduler with a module as the scope, except
    that the modules of _heavy_modules are one unit (one process). The units
    come from a file each worker writes after its collection (before it
    reports the collection, so that it is there when the scheduler starts;
    the workers' collections are the same, or xdist stops the run):
    xdist's own `--dist loadgroup` appends a group to each test's node id,
    and pytest 9.2 ignores that (pytest-xdist#1386): the groups were lost
    silently and both processes loaded SmolLM2."""
    import glob
    import json

    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        units: dict[str, str] | None = None

        def schedule(self) -> None:
            if self.units is None:
                found = sorted(glob.glob(os.path.join(config.stash[_UNITS_DIR], "*.json")))
                self.units = json.loads(pathlib.Path(found[0]).read_text()) if found else {}
            super().schedule()

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return (self.units or {}).get(module, module)

    return ModuleScheduling(config, log)


# -- a crash names its test ---------------------------------------------------------------

@pytest.hookimpl(trylast=True)                  # after pytest's faulthandler plugin enabled it
def pytest_configure(config):
    """Paddle replaces the fatal-signal handlers on import (pytest's
    faulthandler among them), so a test that dies by SIGILL or SIGSEGV in a
    kernel left no word of which test it was. Import Paddle now and enable
    faulthandler again over its handlers, writing to stderr as it was before
    pytest captured it: the Python traceback then names the test.
    (Also registers the module order of _heavy_modules_first and the
    fixtures' costs of FDX_TEST_MEASURE.)"""
    if not config.pluginmanager.has_plugin("fdx-heavy-modules-first"):
        config.pluginmanager.register(_HeavyModulesFirst(), "fdx-heavy-modules-first")
        config.pluginmanager.register(_FixtureCosts(), "fdx-fixture-costs")
    import faulthandler
    import warnings
    if not faulthandler.is_enabled() or config.stash.get(_OURS, False):
        return                                   # -p no:faulthandler, or xdist's controller (runs no test)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle  # noqa: F401
    except ImportError:
        return
    faulthandler.disable()
    faulthandler.enable(file=os.dup(2), all_threads=True)


# -- leave the environment as it was found -------------------------------------------------

def local_build_flags() -> list[str]:
    """pip's flags to build a package here: with this interpreter's
    setuptools when it is new enough (no download), else in pip's isolated
    build environment (setuptools comes from the index; nothing stays)."""
    try:
        local = int(importlib.metadata.version("setuptools").split(".")[0]) >= 68   # the pyprojects' requirement
    except importlib.metadata.PackageNotFoundError:
        local = False
    return ["--no-build-isolation"] if local else []


def site_folders() -> list[str]:
    """This interpreter's install folders: a virtualenv's own or the base
    interpreter's, and the user's when it is on."""
    import site
    folders = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    return [f for f in folders if os.path.isdir(f)]


def installed_distributions() -> set[tuple[str, str, str]]:
    """(name, version, folder) of every distribution in site_folders():
    what `pip list` lists."""
    importlib.invalidate_caches()
    return {(d.metadata["Name"], d.version, str(d.locate_file("")))
            for d in importlib.metadata.distributions(path=site_folders())}


def make_venv(path: pathlib.Path, with_pip: bool = True) -> pathlib.Path:
    """A virtualenv that imports this interpreter's packages after its own,
    through a .pth that adds each of site_folders() (--system-site-packages
    would add the base interpreter's, which from inside a virtualenv are not
    this one's). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(path)],
                   check=True, timeout=300)
    py = path / "bin" / "python"
    own = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True).stdout.strip()
    pathlib.Path(own, "outer-site.pth").write_text(
        "".join(f"import site; site.addsitedir({d!r})\n" for d in site_folders()))
    return py


_DISTRIBUTIONS = pytest.StashKey[set]()


def pytest_sessionstart(session):
    if not hasattr(session.config, "workerinput"):       # xdist's workers: their controller checks
        session.config.stash[_DISTRIBUTIONS] = installed_distributions()


def _dpkg_packages() -> set[str]:
    out = subprocess.run(["dpkg-query", "-W", "-f", "${binary:Package} ${db:Status-Abbrev}\n"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["ii"]}


_APT_INSTALLED: set[str] = set()                 # Debian packages this session brought


def _apt_lock():
    """One apt-get at a time across the suite's processes (xdist's workers):
    a second one fails on dpkg's lock instead of waiting, and each process
    must see only its own packages arrive."""
    import fcntl
    import tempfile
    lock = open(os.path.join(tempfile.gettempdir(), "fdx-tests-apt.lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    return lock                                  # released when closed


def apt_install(package: str) -> None:
    """Install a Debian package for this session only (CI runs as root):
    it and what it brought along are purged when the session ends."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with _apt_lock():
        before = _dpkg_packages()
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True, timeout=900)
        try:
            subprocess.run(["apt-get", "install", "-y", "-q", package], check=True, env=env, capture_output=True,
                           timeout=1800)
        finally:
            _APT_INSTALLED.update(_dpkg_packages() - before)


def _apt_purge() -> None:
    if _APT_INSTALLED:
        with _apt_lock():
            subprocess.run(["apt-get", "purge", "-y", "-q", *sorted(_APT_INSTALLED)], check=True,
                           capture_output=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
        _APT_INSTALLED.clear()


def pytest_sessionfinish(session, exitstatus):
    """The suite installs nothing into the environment it runs in: the
    Debian packages it installed are purged, and a Python distribution
    added, removed or changed during the run fails it. (FDX_TEST_MEASURE:
    also a line with the process's peak resident MiB.)"""
    _apt_purge()
    out = _measure_file(session.config)
    if out is not None:
        _measure_line(out, session_peak_rss_mib=_proc_status_mib("VmHWM")["VmHWM"])
    before = session.config.stash.get(_DISTRIBUTIONS, None)
    if before is None:
        return
    after = installed_distributions()
    if after != before:
        lines = [f"  added {n} {v} in {f}" for n, v, f in sorted(after - before)]
        lines += [f"  removed {n} {v} from {f}" for n, v, f in sorted(before - after)]
        session.config.get_terminal_writer().line(
            "the test run changed the Python environment it ran in:\n" + "\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_report_header(config):
    stale = sorted({f for n, _, f in config.stash.get(_DISTRIBUTIONS, set()) if n == "fdx-example-plugin"})
    if stale:
        return [f"fdx-example-plugin is installed in {', '.join(stale)} (left by an older test run); the tests "
                "use a copy of their own, and `pip uninstall fdx-example-plugin` removes that one"]
    return None


def _drop_example_modules() -> None:
    for name in [m for m in sys.modules if m == "fdx_example_plugin" or m.startswith("fdx_example_plugin.")]:
        del sys.modules[name]
    import fdx.core.plugins
    fdx.core.plugins._default = None             # built without (or with) it: rebuild on next use
    fdx.core.plugins._serving = None


@pytest.fixture(autouse=True)
def _cli_environment_restored():
    """``fdx.entrypoints.cli.main`` exports FDX_LOG_LEVEL (for the engine process)
    and drops OMP_NUM_THREADS: a test that calls it in process (``--quiet``
    exports WARNING) must not change the level of every server a later test
    starts (request log lines went missing that way). It also gives the
    ``fdx`` logger a handler of its own and stops it propagating
    (fdx.core.logs.configure): caplog, on the root logger, would then see
    nothing of a later test's fdx lines."""
    import logging
    saved = {k: os.environ.get(k) for k in ("FDX_LOG_LEVEL", "OMP_NUM_THREADS")}
    fdx = logging.getLogger("fdx")
    level, handlers, propagate = fdx.level, list(fdx.handlers), fdx.propagate
    yield
    fdx.setLevel(level)
    fdx.handlers[:] = handlers
    fdx.propagate = propagate
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# -- what the suite costs ------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)                  # before xdist reports the collection
def pytest_collection_finish(session):
    """Every engine load runs a full garbage collection (fdx.core.host.
    release_free_heap), and in this process it walks every object torch,
    transformers, Paddle and the collected test modules made: move those
    into the permanent generation once collected, so that a collection
    looks only at what the tests made since. (A worker of xdist also writes
    the heavy unit for ModuleScheduling.)"""
    folder = getattr(session.config, "workerinput", {}).get("fdx_units")
    if folder:
        import json
        unit = {m: "smollm" for m in _heavy_modules(session.items)}
        tmp = pathlib.Path(folder, f"{session.config.workerinput['workerid']}.tmp")
        tmp.write_text(json.dumps(unit))
        os.replace(tmp, tmp.with_suffix(".json"))
    import gc
    gc.collect()
    gc.freeze()


_MEASURE = pytest.StashKey[object]()


def _proc_status_mib(*keys: str) -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(line.split()[1]) // 1024 for line in f for k in keys if line.startswith(k + ":")}


def _measure_file(config):
    """FDX_TEST_MEASURE's file, opened once a process (each xdist worker
    appends its own lines, one write each), or None when not measuring."""
    path = os.environ.get("FDX_TEST_MEASURE")
    if not path or not os.path.exists("/proc/self/status"):
        return None
    out = config.stash.get(_MEASURE, None)
    if out is None:
        out = config.stash[_MEASURE] = open(path, "a", buffering=1)
    return out


def _measure_line(out, **fields) -> None:
    import json
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    out.write(json.dumps({**fields, **({"worker": worker} if worker else {})}) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """The transformers references' torch on one thread, in every module
    (tests/torch_threads.py says why: a reference decodes a row at a time,
    where torch's second OpenMP thread only spins; with two test processes
    on two cores it also takes the other process's core). Set once torch is
    imported (by a test or a fixture), never importing it here. Paddle's
    threads and fdx's kernels are not torch's and do not change."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """FDX_TEST_MEASURE=file: one JSON line a test (wall and CPU seconds,
    this process's and its waited children's, resident MiB now and at its
    peak, and the xdist worker that ran it) so that a contributor sees what
    a new test costs (tests/README.md)."""
    out = _measure_file(item.config)
    if out is None:
        yield
        return
    import time
    t0, c0 = time.monotonic(), os.times()
    yield
    c1 = os.times()
    mem = _proc_status_mib("VmRSS", "VmHWM")
    _measure_line(
        out, test=item.nodeid, wall_s=round(time.monotonic() - t0, 3),
        cpu_s=round(c1.user - c0.user + c1.system - c0.system, 3),
        children_cpu_s=round(c1.children_user - c0.children_user + c1.children_system - c0.children_system, 3),
        rss_mib=mem.get("VmRSS"), peak_rss_mib=mem.get("VmHWM"))


_LAST_USERS = pytest.StashKey[dict]()


def _session_fixtures_by_last_user(items) -> dict[str, list]:
    """nodeid of an item -> the session-scoped fixtures (their FixtureDefs) to
    tear down after it: those that no later item uses. An item uses a
    fixture when any item of its module needs it (its ``fixturenames``
    closure: directly or through another fixture, since a module-scoped
    fixture may hold it until the module ends) or the module's source asks
    for it by name (``request.getfixturevalue("name")``). The FixtureDefs come
    from each item's fixture info (pytest's, private: pytest 9.2 dropped the
    fixture manager's map the first version read; if this one goes too,
    nothing is torn down early and the suite only holds more memory)."""
    defs: dict[str, list] = {}                  # our session fixtures' names -> their FixtureDefs
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name, fixturedefs in getattr(info, "name2fixturedefs", {}).items():
            ours = [d for d in fixturedefs if _ours(d)]
            if ours:
                defs.setdefault(name, ours)
    last_index: dict[str, int] = {}             # module -> index of its last item
    used: dict[str, set] = {}                   # module -> our session fixtures it uses
    for i, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        last_index[module] = i
        if module not in used:
            try:
                text = item.path.read_text()
            except (OSError, AttributeError):
                text = ""
            used[module] = {n for n in defs if f'getfixturevalue("{n}")' in text}
        used[module].update(n for n in getattr(item, "fixturenames", ()) if n in defs)
    last: dict[str, int] = {}
    for module, names in used.items():
        for n in names:
            last[n] = max(last.get(n, -1), last_index[module])
    out: dict[str, list] = {}
    for n, i in last.items():
        out.setdefault(items[i].nodeid, []).extend(defs[n])
    return out


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """A session fixture is torn down after the last module that uses it,
    not at the end of the session: the session's SmolLM2 engine and its
    transformers twin (about 1.3 GB together) are not resident while the
    modules after them run (tests/README.md)."""
    yield
    plan = item.config.stash.get(_LAST_USERS, None)
    if plan is None:
        plan = item.config.stash[_LAST_USERS] = _session_fixtures_by_last_user(item.session.items)
    done = plan.get(item.nodeid, ())
    request = getattr(item, "_request", None)
    for fixturedef in done:
        if fixturedef.cached_result is not None and request is not None:
            fixturedef.finish(request)
    if done:
        from fdx.core.host import release_free_heap
        release_free_heap()


def _ours(fixturedef) -> bool:
    """A session-scoped fixture defined in tests/ (not one of pytest's)."""
    code = getattr(fixturedef.func, "__code__", None)
    return (fixturedef.scope == "session" and code is not None
            and pathlib.Path(code.co_filename).resolve().is_relative_to(ROOT / "tests"))


class _FixtureCosts:
    """Registered as a plugin (pytest_configure): a conftest's own
    pytest_fixture_setup is not called for a session-scoped fixture (pytest
    asks the hooks of the session node's folder, above tests/), and those
    are the costly ones (smollm_llm, hf_smollm_model)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        yield from _fixture_cost(fixturedef, request)


def _fixture_cost(fixturedef, request):
    """FDX_TEST_MEASURE=file: also one JSON line a fixture set-up that took
    over half a second of CPU (this process's and its waited children's) or
    grew the resident set by over 100 MiB: what a shared fixture costs once."""
    out = _measure_file(request.config)
    if out is None:
        yield
        return
    import time
    t0, c0, r0 = time.monotonic(), os.times(), _proc_status_mib("VmRSS")["VmRSS"]
    yield
    c1, r1 = os.times(), _proc_status_mib("VmRSS")["VmRSS"]
    cpu = c1.user - c0.user + c1.system - c0.system
    children = c1.children_user - c0.children_user + c1.children_system - c0.children_system
    if cpu + children > 0.5 or r1 - r0 > 100:
        _measure_line(
            out, fixture=fixturedef.argname, scope=fixturedef.scope, node=request.node.nodeid,
            wall_s=round(time.monotonic() - t0, 3), cpu_s=round(cpu, 3), children_cpu_s=round(children, 3),
            rss_growth_mib=r1 - r0)


@pytest.fixture(autouse=True, scope="module")
def _memory_released_after_each_module():
    """Engines a module built (and dropped) hold their weights, KV tensors
    and Paddle's buffers until a garbage collection finds their cycles, and
    glibc keeps the freed pages resident: collect and trim after each
    module, so that one module's engines are gone before the next builds its
    own (the suite's peak resident set is one module's, not their sum)."""
    yield
    from fdx.core.host import release_free_heap
    release_free_heap()


@pytest.fixture(scope="session")
def example_plugin_installed(tmp_path_factory):
    """The third-party test plugin, installed with pip as a user would, but
    into a folder of this session only (`pip install --target`): it goes
    first on sys.path and on PYTHONPATH (for the processes tests start), and
    its entry points come from the dist-info there. It shadows a copy an
    older run may have left in the environment, and is gone afterwards."""
    import shutil
    tmp = tmp_path_factory.mktemp("example_plugin")
    src, target = tmp / "src", tmp / "site"
    shutil.copytree(PLUGIN_PKG, src)             # a build in place would leave build/ and egg-info here
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *local_build_flags(),
                    "--target", str(target), str(src)], check=True)
    old_pythonpath = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), *([old_pythonpath] if old_pythonpath else [])])
    importlib.invalidate_caches()
    _drop_example_modules()                      # an old copy imported earlier in this session
    (dist,) = [ep.dist for ep in importlib.metadata.entry_points(group="fdx") if ep.name == "example"]
    assert dist.locate_file("") == target, dist.locate_file("")
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        if old_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pythonpath
        importlib.invalidate_caches()
        _drop_example_modules()


@pytest.fixture(scope="session")
def smollm_llm():
    """One SmolLM2 engine for the session: small pool, sized for tests. In
    float32 (quantization none, not the default auto): the tests compare it
    with transformers on the file's dequantized weights, and other engines
    with it (each of those pins none too)."""
    from fdx import LLM
    with LLM(max_model_len=512, max_num_seqs=16, num_kv_blocks=256, block_size=16, quantization="none",
             progress=False) as llm:
        yield llm


def smollm_gguf_path() -> str:
    from fdx.model_io.loader import default_model_path
    return default_model_path()


TINY_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM")


def tiny_hf_config(arch: str, tie: bool = True):
    """A tiny config of each architecture, with the SmolLM2 vocabulary."""
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "LlamaForCausalLM":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(rope_theta=1e6, **common)
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(head_dim=32, rope_theta=1e6, **common)
    if arch == "Ernie4_5ForCausalLM":
        return transformers.Ernie4_5Config(head_dim=16, rope_theta=500000.0, use_bias=False, **common)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def smollm_hf_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer as transformers reads it from the GGUF, saved as
    an HF tokenizer folder (tokenizer.json, tokenizer_config.json)."""
    import transformers
    path = pathlib.Path(smollm_gguf_path())
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out = tmp_path_factory.mktemp("smollm_tok")
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm_hf_tokenizer_dir):
    """A tiny random Llama (2 layers, hidden 64) with a 4096-token context,
    so that a stream can stay open for a while."""
    import shutil

    import torch
    import transformers
    cfg = tiny_hf_config("LlamaForCausalLM")
    cfg.max_position_embeddings = 4096
    torch.manual_seed(13)
    d = tmp_path_factory.mktemp("tiny_llama_4k")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(d), safe_serialization=True)
    for f in smollm_hf_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return str(d)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm_hf_tokenizer_dir):
    """arch -> (HF dir written by transformers, the torch model) for each architecture."""
    import shutil
    import torch
    import transformers
    out = {}
    for i, arch in enumerate(TINY_ARCHS):
        torch.manual_seed(1234 + i)
        cfg = tiny_hf_config(arch, tie=(i % 2 == 0))
        model = getattr(transformers, arch)(cfg).eval()
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(str(d), safe_serialization=True)
        for f in smollm_hf_tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        out[arch] = (d, model)
    return out


@pytest.fixture(scope="session")
def hf_smollm_model():
    import torch
    import transformers
    path = pathlib.Path(smollm_gguf_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_logits(hf_smollm_model):
    """ids -> float64 log-softmax of transformers' logits at every position."""
    import numpy as np
    import torch

    def run(ids):
        with torch.no_grad():
            logits = hf_smollm_model(torch.tensor([ids])).logits[0].double().numpy()
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return run
