"""Where a decode step's time goes: ``fdx bench throughput --profile``.

Each engine step of the benchmark runs under its own ``cProfile.Profile``;
the steps kept are the decode-only ones at the full batch (every running
request decoding one token, none prefilling). Their profiles are merged
and split into three parts:

- **GEMMs**: Paddle's matmul kernels called from the model (not from ops/,
  where a small matmul is an elementwise trick such as rotary's rotation);
- **attention**: the attention backend's forward (the compiled kernel, or
  the Paddle path when it is off), everything under it;
- **outside**: the rest of the step: elementwise ops (norms, activation,
  rotary, KV write), input building, logits to the host, logits processors,
  sampling, scheduling and output processing.

With the cpu backend's whole-layer kernel (``cpp.decoder_layer``, GGML-block
weights) a layer's products, attention and elementwise ops are one compiled
call, reported among the ops as ``compiled fdx_decoder_layer``, and with the
one call for all layers (``cpp.decoder_stack``) a step's layers are one, as
``compiled fdx_decoder_stack``: their products and attention are then in
neither share. The op calls a step (Paddle's and the compiled ones) are counted.

The profiler adds its own cost to each Python call, so the outside share
measured here is an upper bound; GEMMs and attention are single calls into
C++ and are timed faithfully. Figures are reported, never asserted.
"""
from __future__ import annotations

import cProfile
import functools
import os
import pstats
import re
from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["StepProfiler", "format_profile"]

# (file fragment, function name) of the phases named in the breakdown, by cumulative time.
_PHASES = {
    "scheduling": [("/schedulers/", "schedule"), ("/core/scheduling.py", "schedule")],
    "output processing": [("/schedulers/", "update"), ("/core/engine.py", "_context")],
    "sampling (processors + sampler)": [("/backends/runner.py", "_sample")],
    "attention metadata": [("", "build_metadata")],
}


def _is_builtin(func: tuple) -> bool:
    return func[0] == "~"


def _builtin_name(func: tuple) -> str:
    """'{built-in method paddle.base.libpaddle.pir.ops.matmul}' -> 'matmul'."""
    name = func[2].strip("{}<>")
    m = re.fullmatch(r"method '(.+)' of '(.+)' objects", name)
    if m:                                    # {method 'copy' of 'numpy.ndarray' objects}
        return f"{m.group(2).rsplit('.', 1)[-1]}.{m.group(1)}"
    return name.removeprefix("built-in method ").rsplit(".", 1)[-1]


@dataclass
class ProfileSummary:
    steps: int = 0
    batch: int = 0
    step_time_s: float = 0.0            # all kept steps together (wall, under the profiler)
    gemm_s: float = 0.0
    attention_s: float = 0.0
    calls: int = 0                      # calls of built-in functions (Paddle and compiled ops, numpy, ...)
    op_calls: int = 0                   # of those, Paddle ops and compiled kernels (paddle's C++ bindings)
    ops: dict[str, float] = field(default_factory=dict)       # outside: Paddle/compiled ops by name
    phases: dict[str, float] = field(default_factory=dict)    # outside: fdx phases (cumulative)

    @property
    def outside_s(self) -> float:
        return max(0.0, self.step_time_s - self.gemm_s - self.attention_s)

    def as_dict(self) -> dict:
        total = self.step_time_s or 1.0
        return {
            "profiled_steps": self.steps, "batch": self.batch,
            "mean_step_ms": 1000 * self.step_time_s / max(self.steps, 1),
            "calls_per_step": self.calls / max(self.steps, 1),
            "op_calls_per_step": self.op_calls / max(self.steps, 1),
            "gemm_share": self.gemm_s / total, "attention_share": self.attention_s / total,
            "outside_share": self.outside_s / total,
            "outside_ops_ms_per_step": {k: 1000 * v / max(self.steps, 1) for k, v in self.ops.items()},
            "outside_phases_ms_per_step": {k: 1000 * v / max(self.steps, 1) for k, v in self.phases.items()},
        }


class StepProfiler:
    """Profiles engine steps one at a time and keeps the decode-only ones at
    the full batch."""

    def __init__(self, batch: int):
        self.batch = batch
        self.stats: pstats.Stats | None = None
        self.steps = 0
        self.step_time_s = 0.0

    def step(self, engine) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            engine.step()
        finally:
            prof.disable()
        s = engine.last_stats
        if s.num_prefill_tokens == 0 and s.num_decode_tokens == self.batch:
            self.steps += 1
            self.step_time_s += s.step_time_s
            if self.stats is None:
                self.stats = pstats.Stats(prof)
            else:
                self.stats.add(prof)

    def summary(self) -> ProfileSummary:
        out = ProfileSummary(steps=self.steps, batch=self.batch, step_time_s=self.step_time_s)
        if self.stats is None:
            return out
        table = self.stats.stats          # func -> (cc, nc, tottime, cumtime, callers)
        attention_funcs = [f for f in table if f[2] == "forward" and "/backends/attention" in f[0]]
        attention_funcs += [f for f in table if f[2] == "attention" and f[0].endswith("core/interfaces.py")]
        # the outermost of the two (AttentionContext.attention wraps the backend's forward)
        out.attention_s = max((table[f][3] for f in attention_funcs), default=0.0)
        under_attention = _reached(table, attention_funcs)
        ops: dict[str, float] = defaultdict(float)
        for func, row in table.items():
            if _is_builtin(func):
                out.calls += row[1]
                if "paddle" in func[2] or "_custom_op" in func[2]:
                    out.op_calls += row[1]
            if not _is_builtin(func) or row[2] <= 0:
                continue
            name = _builtin_name(func)
            for caller, t in _own_callers(table, func).items():
                if caller in under_attention:          # counted in attention_s
                    continue
                if name == "matmul":
                    if "/ops/" in caller[0]:
                        ops["matmul (inside ops/)"] += t
                    else:
                        out.gemm_s += t
                elif name in ("_run_custom_op", "run_custom_op") and caller[2] in _COMPILED_PRODUCTS:
                    out.gemm_s += t                       # a linear's product in a compiled kernel
                elif name in ("_run_custom_op", "run_custom_op"):
                    ops[f"compiled {caller[2]}"] += t     # a compiled kernel, by its Python wrapper
                else:
                    ops[name] += t
        # the one call for all layers goes through ctypes, which the profiler does not see as a
        # call of its own: its time is the Python wrapper's own
        ops["compiled fdx_decoder_stack"] += sum(row[2] for f, row in table.items()
                                                 if f[2] == "decoder_stack" and f[0].endswith("ops/cpp.py"))
        out.ops = {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v > 0}
        for phase, keys in _PHASES.items():
            out.phases[phase] = sum(row[3] for f, row in table.items()
                                    if any(frag in f[0] and f[2] == fn for frag, fn in keys))
        return out


# the compiled ops that are a linear layer's product (fdx.ops.cpp): GEMMs as paddle.matmul is
_COMPILED_PRODUCTS = frozenset({"fdx_f32_matmul", "fdx_quant_matmul"})


def _reached(table: dict, roots: list[tuple]) -> set[tuple]:
    """Every function ``roots`` call, directly or not (the roots included)."""
    children: dict[tuple, list[tuple]] = defaultdict(list)
    for func, row in table.items():
        for caller in row[4]:
            children[caller].append(func)
    reached, frontier = set(roots), list(roots)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            if child not in reached:
                reached.add(child)
                frontier.append(child)
    return reached


@functools.cache
def _paddle_dir() -> str:
    import paddle
    return os.path.dirname(paddle.__file__) + os.sep


def _own_callers(table: dict, func: tuple, depth: int = 8) -> dict[tuple, float]:
    """``func``'s own time split over its callers outside Paddle's Python
    package: a call through one of Paddle's wrappers (``paddle.matmul`` is
    one) is charged to the wrappers' callers, in proportion to the time each
    spent in the wrapper."""
    found: dict[tuple, float] = defaultdict(float)
    stack = [(caller, c[2], depth) for caller, c in table[func][4].items()]
    while stack:
        caller, t, left = stack.pop()
        parents = table[caller][4] if caller in table else {}
        if caller[0].startswith(_paddle_dir()) and parents and left:
            total = sum(p[3] for p in parents.values()) or 1.0
            stack += [(parent, t * p[3] / total, left - 1) for parent, p in parents.items()]
        else:
            found[caller] += t
    return found


def format_profile(p: dict) -> str:
    if not p["profiled_steps"]:
        return "  profile          no decode-only step ran at the full batch (more output tokens?)"
    lines = [
        f"  profile          {p['profiled_steps']} decode-only steps at {p['batch']} sequences, "
        f"mean {p['mean_step_ms']:.1f} ms under cProfile, {p.get('op_calls_per_step', 0):.0f} Paddle/compiled op "
        f"calls a step ({p.get('calls_per_step', 0):.0f} built-in calls in all)",
        f"    GEMMs          {100 * p['gemm_share']:5.1f}%",
        f"    attention      {100 * p['attention_share']:5.1f}%",
        f"    outside        {100 * p['outside_share']:5.1f}%   (target: under 10%)",
    ]
    ops = p["outside_ops_ms_per_step"]
    if ops:
        lines.append("    outside, by op (ms a step): " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in list(ops.items())[:10]))
    phases = p["outside_phases_ms_per_step"]
    if phases:
        lines.append("    outside, by phase (ms a step, ops included): " + ", ".join(
            f"{name} {ms:.2f}" for name, ms in phases.items()))
    return "\n".join(lines)
