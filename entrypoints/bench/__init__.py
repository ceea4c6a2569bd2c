"""Benchmarks: fdx bench throughput | serve | prefix | peers (the last from scripts/, see load_peers)."""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

PEERS_MODULE = "fdx_bench_peers"
PEERS_ENV = "FDX_PEERS_TOOL"


class PeersToolMissing(RuntimeError):
    """``fdx bench peers`` asked for where its tool is not on disk (an installed wheel)."""


def peers_tool_dir() -> Path:
    """Where the peers tool lives: $FDX_PEERS_TOOL, else scripts/bench_peers of the source tree fdx runs from."""
    env = os.environ.get(PEERS_ENV)
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[2] / "scripts" / "bench_peers"


def load_peers():
    """The ``fdx bench peers`` tool, imported on demand. It builds llama.cpp
    and ik_llama.cpp, so it is a developer tool outside the runtime package:
    it ships in a source checkout (scripts/bench_peers/), not in the wheel."""
    where = peers_tool_dir()
    if not (where / f"{PEERS_MODULE}.py").is_file():
        raise PeersToolMissing(
            f"fdx bench peers is a developer tool kept in the source tree (scripts/bench_peers/), not in the "
            f"installed package, and {where} does not hold it: run it from a checkout of fdx "
            f"(pip install -e '.[cpu]' there, or python scripts/bench_peers/{PEERS_MODULE}.py), or set "
            f"{PEERS_ENV} to a checkout's scripts/bench_peers")
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return importlib.import_module(PEERS_MODULE)
