"""The cpu backend's probed kernel table (fdx.core.kernels, plugins/backends/probing.py).

On any CPU, with or without AVX-512: a probe child that dies by SIGILL
leads to the reference kernel, and the engine's greedy tokens then equal
transformers'; a kernel whose numbers differ from the reference is
refused; a second start reads the cache and spawns no probe; a cache file
written for other CPU flags is never read. Faults are injected into the
probe child only (tests/data/probe_faults/sitecustomize.py, through
PYTHONPATH); the parent, the probing code and the engine are the real ones.
Then the guards: no fused Paddle kernel or compiled op is called outside a
function declared with ``@kernels.implements``, and a forward calls only
the implementations its table passed.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from fdx.core import hookspecs, kernels
from fdx.core.kernels import KernelTable
from fdx.plugins.backends import cpu, probing
from test_contracts import GREEDY, PROMPTS, cpu_kernel_table, make_llm, prompts, token_ids

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAULTS = ROOT / "tests" / "data" / "probe_faults"


@pytest.fixture
def tiny_hf(tiny_checkpoints):
    path, model = tiny_checkpoints["LlamaForCausalLM"]
    return str(path), model


@pytest.fixture
def probe_env(tmp_path, monkeypatch):
    """A fresh kernel-table cache (the compiled kernels keep theirs), the
    fault injector on the probe child's path, and a log of children started.
    The layout probes time a 1024 x 2048 weight, not 16384 x 2048: their
    findings are measured choices, which no test here compares, and the
    portable build's timing of the large one was about 16 of each probe
    child's 18 CPU-s."""
    cpu_kernel_table()                       # the host's own table, probed (or read) before any fault is set
    monkeypatch.setattr(probing, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(FAULTS), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("FDX_TEST_INTERLEAVE_SHAPE", "1024x2048")
    log = tmp_path / "children.log"
    monkeypatch.setenv("FDX_TEST_PROBE_LOG", str(log))
    monkeypatch.setattr(cpu, "_logged", set())
    return lambda: log.read_text().count("child") if log.exists() else 0


def host_deaths() -> int:
    """Probe children this host's own kernels kill (Paddle's fused_rms_norm without AVX-512);
    a build for an instruction set dies in a fork of the child, not the child (fdx.ops.probes.isolated)."""
    from fdx.ops.probes import isolated
    return sum(why == "SIGILL on this CPU" and not isolated(name) for name, why in cpu_kernel_table().findings.items())


def hf_greedy_all(model, n):
    from test_llm import hf_greedy
    return [hf_greedy(model, p, n) for p in PROMPTS]


def engine_with_faults(tiny_hf, monkeypatch, faults: str):
    """An LLM on the tiny model whose probe child had ``faults`` injected:
    (llm, its kernel table, the transformers model)."""
    path, hf = tiny_hf
    monkeypatch.setenv("FDX_TEST_FAULTS", faults)
    llm = make_llm(path)
    return llm, llm.engine.backend.kernels, hf


def assert_transformers_tokens_without(llm, hf, monkeypatch, kernel: str) -> None:
    """Greedy tokens equal transformers' and the compiled ``kernel`` never ran."""
    from fdx.ops import cpp
    calls = []
    real = getattr(cpp, kernel)
    monkeypatch.setattr(cpp, kernel, lambda *a: (calls.append(1), real(*a))[1])
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy_all(hf, GREEDY.max_tokens)
    assert not calls, f"the refused {kernel} ran"


@pytest.mark.slow
def test_a_probe_killed_by_sigill_leads_to_the_reference_and_transformers_tokens(tiny_hf, probe_env, monkeypatch):
    llm, table, hf = engine_with_faults(tiny_hf, monkeypatch, "cpp.silu_and_mul=sigill,cpp.add_rms_norm=sigill")
    host = cpu_kernel_table()
    assert table.source == "probed" and probe_env() == 1 + 2 + host_deaths()   # a new child after each death
    assert table["cpp.silu_and_mul"] == table["cpp.add_rms_norm"] == "SIGILL on this CPU"
    for name in cpu.KERNELS:                                          # every other finding is the host's own
        if name not in ("cpp.silu_and_mul", "cpp.add_rms_norm") + cpu.LAYOUT_KERNELS:   # layouts: timed
            assert table[name] == host[name], name
    choices = llm.engine.backend.kernel_choices()
    assert choices["silu_and_mul"].startswith("swiglu (cpp.silu_and_mul: SIGILL on this CPU")
    assert "cpp.add_rms_norm: SIGILL on this CPU" in choices["rms_norm"]
    assert_transformers_tokens_without(llm, hf, monkeypatch, "silu_and_mul")


@pytest.mark.slow
def test_a_kernel_whose_numbers_differ_is_refused(tiny_hf, probe_env, monkeypatch):
    llm, table, hf = engine_with_faults(tiny_hf, monkeypatch, "cpp.paged_attention=wrong,swiglu=wrong")
    assert table["cpp.paged_attention"].startswith("wrong result (mixed prefill and decode: max error")
    assert table["swiglu"].startswith("wrong result (")
    assert probe_env() == 1 + host_deaths()                           # refused, not dead: no child more
    assert_transformers_tokens_without(llm, hf, monkeypatch, "paged_attention")   # the Paddle attention ran


@pytest.mark.slow
def test_the_second_start_reads_the_cache_and_spawns_no_probe(tiny_hf, probe_env):
    path, _ = tiny_hf
    first = make_llm(path).engine.backend.kernels
    children = probe_env()
    assert first.source == "probed" and children == 1 + host_deaths()
    second = make_llm(path).engine.backend.kernels
    assert second.source == "cache" and probe_env() == children and second.findings == first.findings
    assert json.loads(pathlib.Path(second.location).read_text())["findings"] == first.findings


@pytest.mark.slow
def test_a_cache_written_for_other_cpu_flags_is_ignored(tiny_hf, probe_env, monkeypatch):
    """A kernel-table file that claims every kernel passes, keyed for an
    AVX-512 CPU, put where this host's file goes (a copied cache folder):
    not read; this host is probed and its own findings hold."""
    path, _ = tiny_hf
    table = make_llm(path).engine.backend.kernels
    children = probe_env()
    assert children == 1 + host_deaths()
    where = pathlib.Path(table.location)
    data = json.loads(where.read_text())
    data["key"]["cpu"] = data["key"]["cpu"].replace("avx2", "avx2 avx512f avx512bw avx512vl") + " avx512f"
    data["findings"] = {name: None for name in data["findings"]}
    where.write_text(json.dumps(data))
    again = make_llm(path).engine.backend.kernels
    assert again.source == "probed" and probe_env() == 2 * children
    timed = set(cpu.LAYOUT_KERNELS)                     # the layout choices are measured: they may differ
    assert {n: f for n, f in again.findings.items() if n not in timed} == \
        {n: f for n, f in table.findings.items() if n not in timed}


def test_the_probe_cache_is_keyed_by_the_cpu_flags(monkeypatch):
    material = probing._key_material(["swiglu"], "")
    monkeypatch.setattr(probing, "cpu_id", lambda: material["cpu"] + " avx512f")
    other = probing._key_material(["swiglu"], "")
    assert probing.cache_path(material) != probing.cache_path(other)


def test_the_compiled_build_is_keyed_by_the_cpu_flags_and_the_portable_setting(monkeypatch):
    from fdx.ops import cpp
    native = cpp.build_dir()
    monkeypatch.setattr(cpp, "cpu_id", lambda: "another cpu avx512f")
    assert cpp.build_dir() != native
    monkeypatch.undo()
    monkeypatch.setenv("FDX_PORTABLE_KERNELS", "1")
    assert cpp.build_dir() != native and "-march=native" not in cpp._cflags()


@pytest.mark.slow
def test_portable_setting_runs_no_paddle_fused_kernel(tiny_hf, probe_env, monkeypatch):
    path, hf = tiny_hf
    monkeypatch.setenv("FDX_PORTABLE_KERNELS", "1")
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")             # (a portable build of the compiled ones: the same path)
    llm = make_llm(path)
    table = llm.engine.backend.kernels
    assert all(table[n] == "off (FDX_PORTABLE_KERNELS)" for n in cpu.PADDLE_KERNELS)
    assert probe_env() == 0                                          # nothing left to probe
    assert token_ids(llm.generate(prompts(), GREEDY)) == hf_greedy_all(hf, GREEDY.max_tokens)


def test_a_probe_child_that_hangs_is_a_timeout_finding(tmp_path, monkeypatch):
    monkeypatch.setattr(probing, "PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(probing.sys, "executable", str(tmp_path / "python"))
    (tmp_path / "python").write_text('#!/bin/sh\necho "start $5"\nexec sleep 30\n')     # $5: the first kernel
    (tmp_path / "python").chmod(0o755)
    found = probing._probe(["swiglu", "fused_rms_norm"], 1, tmp_path / "log")
    assert found == {"swiglu": "the probe timed out after 0 s", "fused_rms_norm": "the probe timed out after 0 s"}


# --- guards: every kernel call goes through the table -------------------------------------------

GUARDED_MODULES = ("paddle.incubate",)      # any attribute of these is a fused kernel
GUARDED_NAMES = {"swiglu"}                  # fused kernels elsewhere in Paddle (paddle.nn.functional)
# plugins' hook implementations are named fdx_* too, and are no kernel
HOOK_NAMES = {name for name in dir(hookspecs) if name.startswith("fdx_")}


def _raw_kernel_calls(tree: ast.AST, aliases: dict[str, str]):
    """(line, text) of each call of a fused Paddle kernel or a compiled op
    (``<module>.fdx_*``) not inside a function decorated with implements(...)."""
    def decorated(fn) -> bool:
        return any("implements" in ast.unparse(d) for d in fn.decorator_list)

    def walk(node, inside: bool):
        for child in ast.iter_child_nodes(node):
            ok = inside or (isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and decorated(child))
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute) and not ok:
                text = ast.unparse(child.func)
                head = text.split(".")[0]
                full = aliases.get(head, head) + text[len(head):]
                if (full.startswith(tuple(m + "." for m in GUARDED_MODULES)) or child.func.attr in GUARDED_NAMES
                        or child.func.attr.startswith("fdx_") or "_C_ops." in full):
                    yield child.lineno, text
            yield from walk(child, ok)
    yield from walk(tree, False)


def test_no_kernel_is_called_outside_a_declared_implementation():
    bad = []
    files = [p for d in ("core", "entrypoints", "model_io", "ops", "plugins") for p in sorted((ROOT / d).rglob("*.py"))
             if not p.name.startswith("bench_")]
    for path in files:
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        bad += [f"{path.relative_to(ROOT)}:{line}: {text}" for line, text in _raw_kernel_calls(tree, aliases)]
    assert not bad, "kernels called without the probed table (declare the caller with @kernels.implements):\n" \
        + "\n".join(bad)


def test_the_guard_finds_an_undeclared_kernel_call():
    src = ("import paddle.incubate.nn.functional as IF\nfrom fdx.core import kernels\n"
           "def f(x):\n    return IF.fused_rms_norm(x)\n"
           "@kernels.implements('fused_rms_norm')\ndef g(x):\n    return IF.fused_rms_norm(x)\n"
           "def h(m, x):\n    return m.fdx_new_kernel(x)\n")
    tree = ast.parse(src)
    aliases = {"IF": "paddle.incubate.nn.functional"}
    assert [line for line, _ in _raw_kernel_calls(tree, aliases)] == [4, 9]


def _implementations_called(run, table: KernelTable) -> tuple[set[str], list[str]]:
    """Run ``run()`` under a profiler: (the kernels whose declared
    implementations were entered, the kernel calls made outside one)."""
    impls = {q: name for name, qs in kernels.IMPLEMENTATIONS.items() for q in qs}
    entered: set[str] = set()
    stray: list[str] = []

    def inside_impl(frame) -> bool:
        while frame is not None:
            if f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}" in impls:
                return True
            frame = frame.f_back
        return False

    def profiler(frame, event, arg):
        if event == "call":
            qual = f"{frame.f_globals.get('__name__')}.{frame.f_code.co_qualname}"
            if qual in impls:
                entered.add(impls[qual])
            elif ("paddle/incubate/" in frame.f_code.co_filename
                  or (frame.f_code.co_name.startswith("fdx_") and frame.f_code.co_name not in HOOK_NAMES)) \
                    and not inside_impl(frame.f_back):
                stray.append(qual)
        elif event == "c_call" and (getattr(arg, "__name__", "").startswith("fused")
                                    or getattr(arg, "__name__", "") in GUARDED_NAMES) and not inside_impl(frame):
            stray.append(arg.__name__)

    sys.setprofile(profiler)
    try:
        run()
    finally:
        sys.setprofile(None)
    return entered, stray


@pytest.mark.slow
@pytest.mark.parametrize("which", ["host", "none"])
def test_a_forward_calls_only_the_kernels_its_table_passed(tiny_hf, which):
    path, hf = tiny_hf
    llm = make_llm(path)
    host = llm.engine.backend.kernels
    table = host if which == "host" else KernelTable({name: "refused by the test" for name in host.findings})
    llm.engine.runner.ctx.kernels = table
    outs = []
    entered, stray = _implementations_called(lambda: outs.append(llm.generate(prompts(), GREEDY)), table)
    assert not stray, f"kernel calls outside a declared implementation: {sorted(set(stray))}"
    assert entered <= {n for n in table.findings if table.usable(n)}
    if which == "host":
        assert entered, "the host's table passed kernels and none ran"
    else:
        assert not entered
    assert token_ids(outs[0]) == hf_greedy_all(hf, GREEDY.max_tokens)


@pytest.mark.slow
def test_fdx_env_prints_the_table_cpu_flags_and_settings():
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "--quiet", "env"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    host = cpu_kernel_table()
    assert "cpu flags:" in text and "MKL_DEBUG_CPU_TYPE=" in text and "OMP_NUM_THREADS=" in text
    for name in cpu.KERNELS:
        line = next(l for l in text.splitlines() if l.strip().startswith(name + " "))
        assert line.split(None, 1)[1] == ("ok" if host[name] is None else host[name])
    assert "rms_norm" in text.split("what runs:")[1]
