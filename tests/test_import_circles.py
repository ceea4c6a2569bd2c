"""No import circle in the package (issue 19): every import of every module
of fdx, at module level or inside a function, read from the source, makes a
graph; a strongly connected part of more than one module is a circle. The
layers import downward only: entry points (cli, serving, bench) -> engine
and contracts -> plugins / ops / checkpoint I/O."""
from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# circles not removed yet, each with why (none left: the GGUF reader moved to
# core/checkpoint/gguf_file.py); the test fails on any other one, and on one of these once it is gone
KNOWN: set[frozenset[str]] = set()


def import_graph() -> dict[str, set[str]]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT)
        if rel.parts[0] in ("tests", "scripts", "build") or any(p.startswith(".") for p in rel.parts):
            continue
        name = ".".join(("fdx",) + rel.with_suffix("").parts).removesuffix(".__init__")
        mods[name] = f
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t not in (m, "fdx"):
                    graph[m].add(t)
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected parts of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), set()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = set()
            while True:
                w = stack.pop()
                on.discard(w)
                part.add(w)
                if w == v:
                    break
            if len(part) > 1:
                out.add(frozenset(part))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_finder_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "fdx.core.engine" in graph and "fdx.plugins.backends.tp" in graph
    found = circles(graph)
    assert found - KNOWN == set(), f"import circles: {[sorted(c) for c in found - KNOWN]}"
    assert KNOWN - found == set(), f"gone, take them off KNOWN: {[sorted(c) for c in KNOWN - found]}"
