"""The kernel table: which kernels beyond plain Paddle math may run here.

A device backend owns kernel choice. Before the engine reports ready it
probes every kernel it may call that is more than plain Paddle math
(Paddle's fused/incubate kernels, fdx's compiled ops), each against the
composed reference, and hands the engine a ``KernelTable``. The ops in
``fdx.ops`` read the table that is installed (``install``), and call a
kernel only when the table says it passed; everything else takes the
composed Paddle reference. The engine installs its backend's table before
each forward, so two engines in one process never see each other's.

Kernel names are strings (``"fused_rms_norm"``, ``"cpp.add_rms_norm"``,
...; docs/backends.md lists them). A function that calls one directly is
declared with ``@implements(name)``: a guard test fails on any direct call
of a fused Paddle kernel or compiled op outside such a function, so a
kernel added later cannot skip the probe.

Plain Python (no Paddle): an outside backend fills a table from
docs/plugins.md alone.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, TypeVar

__all__ = ["KernelTable", "REFERENCE", "using", "active", "implements", "IMPLEMENTATIONS"]

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True, slots=True)
class KernelTable:
    """What a backend's probe found.

    findings: kernel name -> None when it ran and matched the reference,
    else why not, in words (``"SIGILL on this CPU"``, ``"wrong result (max
    error 0.3)"``, ``"off (FDX_PORTABLE_KERNELS)"``). A name that is absent
    was not probed and counts as unusable.
    source: where the findings came from ("probed", "cache", "in-process",
    "none"), how long that took and where they are cached, for the log
    line and ``fdx env``."""

    findings: dict[str, str | None] = field(default_factory=dict)
    source: str = "none"
    seconds: float = 0.0
    location: str = ""                 # where the findings are cached, if anywhere
    batch_invariant: bool = False      # backend.batch_invariant: the ops take the kernels whose
                                       # per-row bits do not depend on the batch (docs/backends.md)

    def __iter__(self):
        return iter(self.findings)

    def __getitem__(self, name: str) -> str | None:
        """The finding for ``name`` (KeyError when it was not probed)."""
        return self.findings[name]

    def usable(self, name: str) -> bool:
        return name in self.findings and self.findings[name] is None

    def why_not(self, name: str) -> str:
        """Why ``name`` does not run ("not probed" when it was not)."""
        return self.findings.get(name) or ("ok" if name in self.findings else "not probed")


REFERENCE = KernelTable()          # nothing probed: every op takes the composed reference

_active: KernelTable = REFERENCE


@contextlib.contextmanager
def using(table: KernelTable):
    """Make ``table`` the one the ops read inside the ``with`` block."""
    global _active
    previous, _active = _active, table
    try:
        yield table
    finally:
        _active = previous


def active() -> KernelTable:
    """The table the ops read now."""
    return _active


IMPLEMENTATIONS: dict[str, list[str]] = {}      # kernel name -> qualified names of the functions calling it


def implements(*names: str) -> Callable[[F], F]:
    """Declare that the decorated function calls the kernels ``names``
    directly; its callers must check ``active().usable(name)`` first. The
    function is returned unchanged (no cost per call)."""
    def mark(fn: F) -> F:
        for name in names:
            IMPLEMENTATIONS.setdefault(name, []).append(f"{fn.__module__}.{fn.__qualname__}")
        return fn
    return mark
