"""Where a decode step's time goes: ``fdx bench throughput --profile``.

Each engine step of the benchmark runs under its own ``cProfile.Profile``;
the steps kept are the decode-only ones at the full batch (every running
request decoding one token, none prefilling). Their profiles are merged
and split into four parts:

- **GEMMs**: Paddle's matmul kernels called for a linear layer (not
  rotary's rotation in ops/rotary.py, a small matmul that is an elementwise
  trick, nor attention's) and the compiled products of a linear layer (``fdx_f32_matmul``,
  ``fdx_quant_matmul``);
- **attention**: the attention backend's forward (the compiled kernel, or
  the Paddle path when it is off), everything under it;
- **compiled layers**: the cpu backend's whole-layer kernel
  (``cpp.decoder_layer``, one call a layer) and the one call for all layers
  (``cpp.decoder_stack``): a layer's products, attention, norms, rotary and
  KV write in one compiled call, which a profiler cannot split. It is the
  model's work, not overhead: on the fused path (the default with GGML-block
  weights) most of a step is here, and GEMMs hold only the lm_head;
- **outside**: the rest of the step: elementwise ops (norms, activation,
  rotary, KV write) when not compiled, input building, logits to the host,
  logits processors, sampling, scheduling and output processing.

Each part's calls are counted too (``calls_per_step_by_part``, and the outside
ops' calls by name): counts are exact and the same on every machine, where
the times move with the load.

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
    layers_s: float = 0.0               # compiled whole layers (products + attention + the rest, one call)
    part_calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PARTS, 0))
    op_counts: dict[str, int] = field(default_factory=dict)   # outside: calls of each op by name
    calls: int = 0                      # calls of built-in functions (Paddle and compiled ops, numpy, ...)
    op_calls: int = 0                   # of those, Paddle ops and compiled kernels (paddle's C++ bindings)
    ops: dict[str, float] = field(default_factory=dict)       # outside: Paddle/compiled ops by name
    phases: dict[str, float] = field(default_factory=dict)    # outside: fdx phases (cumulative)

    @property
    def outside_s(self) -> float:
        return max(0.0, self.step_time_s - self.gemm_s - self.attention_s - self.layers_s)

    def as_dict(self) -> dict:
        total = self.step_time_s or 1.0
        return {
            "profiled_steps": self.steps, "batch": self.batch,
            "mean_step_ms": 1000 * self.step_time_s / max(self.steps, 1),
            "calls_per_step": self.calls / max(self.steps, 1),
            "op_calls_per_step": self.op_calls / max(self.steps, 1),
            "gemm_share": self.gemm_s / total, "attention_share": self.attention_s / total,
            "compiled_layers_share": self.layers_s / total, "outside_share": self.outside_s / total,
            "calls_per_step_by_part": {k: v / max(self.steps, 1) for k, v in self.part_calls.items()},
            "outside_ops_ms_per_step": {k: 1000 * v / max(self.steps, 1) for k, v in self.ops.items()},
            "outside_op_calls_per_step": {k: v / max(self.steps, 1) for k, v in self.op_counts.items()},
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
        outermost = max(attention_funcs, key=lambda f: table[f][3], default=None)
        if outermost is not None:
            out.attention_s = table[outermost][3]
            out.part_calls["attention"] = table[outermost][1]
        under_attention = _reached(table, attention_funcs)
        ops: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for func, row in table.items():
            if _is_builtin(func):
                out.calls += row[1]
                if "paddle" in func[2] or "_custom_op" in func[2]:
                    out.op_calls += row[1]
            if not _is_builtin(func):
                continue
            name = _builtin_name(func)
            for caller, (t, n) in _own_callers(table, func).items():
                if caller in under_attention:          # counted in attention_s
                    continue
                custom = name in ("_run_custom_op", "run_custom_op")
                if (name == "matmul" and not caller[0].endswith(_NOT_PRODUCTS)) \
                        or (custom and caller[2] in _COMPILED_PRODUCTS):
                    out.gemm_s += t                    # a linear's product: Paddle's or a compiled kernel
                    out.part_calls["gemm"] += n
                else:
                    key = ("matmul (rotary)" if name == "matmul"
                           else f"compiled {caller[2]}" if custom     # a compiled kernel, by its Python wrapper
                           else name)
                    ops[key] += t
                    counts[key] += n
        # the compiled layers (fdx.ops.layer_port: decoder_stack, decoder_layer) go through ctypes,
        # which the profiler does not see as a call of its own: its time is the own time of the
        # Python function that makes the call (fdx.ops.cpp._run)
        for f, row in table.items():
            if f[2] == "_run" and f[0].endswith("ops/cpp.py"):
                out.layers_s += row[2]
                out.part_calls["compiled layers"] += row[1]
        out.ops = {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v > 0 or counts[k] >= 0.5}
        out.op_counts = {k: round(counts[k]) for k in out.ops}
        for phase, keys in _PHASES.items():
            out.phases[phase] = sum(row[3] for f, row in table.items()
                                    if any(frag in f[0] and f[2] == fn for frag, fn in keys))
        return out


# the compiled ops that are a linear layer's product (fdx.ops.cpp): GEMMs as paddle.matmul is
_COMPILED_PRODUCTS = frozenset({"fdx_f32_matmul", "fdx_quant_matmul"})
# the files whose paddle.matmul is no linear's product (attention's are under attention anyway)
_NOT_PRODUCTS = ("ops/rotary.py",)
_PARTS = ("gemm", "attention", "compiled layers")


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


def _own_callers(table: dict, func: tuple, depth: int = 8) -> dict[tuple, tuple[float, float]]:
    """``func``'s own time and calls split over its callers outside Paddle's
    Python package: a call through one of Paddle's wrappers (``paddle.matmul``
    is one) is charged to the wrappers' callers, the time in proportion to
    the time each spent in the wrapper and the calls to the calls each made."""
    found: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    stack = [(caller, c[2], c[1], depth) for caller, c in table[func][4].items()]
    while stack:
        caller, t, n, left = stack.pop()
        parents = table[caller][4] if caller in table else {}
        if caller[0].startswith(_paddle_dir()) and parents and left:
            time = sum(p[3] for p in parents.values()) or 1.0
            calls = sum(p[1] for p in parents.values()) or 1
            stack += [(parent, t * p[3] / time, n * p[1] / calls, left - 1) for parent, p in parents.items()]
        else:
            found[caller][0] += t
            found[caller][1] += n
    return {k: (t, n) for k, (t, n) in found.items()}


def format_profile(p: dict) -> str:
    if not p["profiled_steps"]:
        return "  profile          no decode-only step ran at the full batch (more output tokens?)"
    lines = [
        f"  profile          {p['profiled_steps']} decode-only steps at {p['batch']} sequences, "
        f"mean {p['mean_step_ms']:.1f} ms under cProfile, {p.get('op_calls_per_step', 0):.0f} Paddle/compiled op "
        f"calls a step ({p.get('calls_per_step', 0):.0f} built-in calls in all)",
        f"    GEMMs          {100 * p['gemm_share']:5.1f}%",
        f"    attention      {100 * p['attention_share']:5.1f}%",
        f"    compiled layers{100 * p.get('compiled_layers_share', 0):5.1f}%   "
        "(whole layers in one compiled call: their products, attention, norms and rotary)",
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
