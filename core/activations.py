"""Per-request activation hooks: capture and add to a request's activations
at named points of the model (docs/research.md, "Activation hooks").

A request asks through ``SamplingParams.activations`` (the same object over
HTTP as the request body's ``activations``)::

    {"capture": [{"point": "residual", "layer": 3, "positions": [0, 16]}],
     "add":     [{"point": "residual", "layer": 3, "vector": [...], "scale": 4.0},
                 {"point": "mlp_out", "layer": 1, "function": "my-plugin-fn", "args": {...}}]}

Points, for decoder layer k (0-based): ``residual`` the residual stream after
layer k (transformers' ``hidden_states[k + 1]``), ``attn_out`` the attention
output (after o_proj, before the residual add), ``mlp_out`` the MLP output.
``positions`` is a half-open range ``[start, stop)`` of token positions
(prompt and generated tokens alike; ``stop`` null: to the end), or absent for
every position. An add applies ``scale * vector`` or a registered activation
function (``fdx_register_activation_functions``) to that request's rows only;
within a point, adds run in the order given and captures see the result.

The runner turns the step's ``BatchLayout`` into a ``StepActivations`` (the
model calls ``apply`` / ``apply_residual``); what it captured goes back in
``ModelRunnerOutput.activations`` (``ActivationCapture``, plain data), and the
scheduler keeps one row per position on the ``Request`` (a recomputed
position after a preemption replaces its row, never adds one).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

POINTS = ("residual", "attn_out", "mlp_out")
MAX_HOOKS = 64                      # capture + add entries per request
MAX_VECTOR = 1 << 16                # floats in one steering vector
# Over HTTP each capture names a closed position range, and all of a request's captures together
# cover at most this many positions (a response holds positions x hidden floats per capture).
MAX_HTTP_CAPTURE_POSITIONS = 256


@dataclass(slots=True)
class ActivationCapture:
    """Rows one capture hook took in one step: the activation at ``point``
    of decoder layer ``layer`` for the token ``positions`` of its request,
    as float32 bytes ``[len(positions), hidden]`` (plain data: it crosses
    the tensor-parallel wire inside ``ModelRunnerOutput``)."""
    point: str                          # "residual" (after the layer), "attn_out" or "mlp_out"
    layer: int
    positions: list[int]
    hidden: int
    data: bytes

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, np.float32).reshape(len(self.positions), self.hidden)


@dataclass(slots=True, frozen=True, eq=False)
class Hook:
    point: str
    layer: int
    start: int                      # first position
    stop: int | None                # past the last position; None: no end
    capture: bool                   # True: capture; False: add
    vector: np.ndarray | None = None    # float32 [hidden], scale applied
    function: str | None = None
    args: Any = None

    @property
    def key(self) -> str:
        return f"{self.point}.{self.layer}"


@dataclass(slots=True, frozen=True, eq=False)
class ActivationSpec:
    """A request's activation hooks, parsed once (a ``BatchLayout.model_args`` entry)."""
    hooks: tuple[Hook, ...]

    @property
    def steers(self) -> bool:
        return any(not h.capture for h in self.hooks)

    @property
    def max_layer(self) -> int:
        return max(h.layer for h in self.hooks)


def _bad(where: str, why: str):
    raise ValueError(f"invalid sampling parameter activations{where}: {why}")


def _int(value: Any, where: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**31:
        _bad(where, f"must be an integer in [{low}, 2**31)")
    return value


def parse(value: Any) -> ActivationSpec | None:
    """``SamplingParams.activations`` checked and parsed (ValueError naming
    the field, e.g. ``activations.add[0].vector``); None for None."""
    if value is None:
        return None
    if isinstance(value, ActivationSpec):
        return value
    if not isinstance(value, dict):
        _bad("", "must be an object with 'capture' and/or 'add' lists")
    unknown = sorted(set(value) - {"capture", "add"})
    if unknown:
        _bad(f".{unknown[0]}", "is not a field (expected 'capture' and/or 'add')")
    hooks = []
    for kind in ("capture", "add"):
        entries = value.get(kind) or []
        if not isinstance(entries, (list, tuple)):
            _bad(f".{kind}", "must be a list")
        for i, e in enumerate(entries):
            hooks.append(_hook(e, kind, f".{kind}[{i}]"))
    if not hooks:
        _bad("", "asks for nothing (give 'capture' or 'add' entries)")
    if len(hooks) > MAX_HOOKS:
        _bad("", f"at most {MAX_HOOKS} capture and add entries")
    return ActivationSpec(tuple(hooks))


def _hook(e: Any, kind: str, where: str) -> Hook:
    if not isinstance(e, dict):
        _bad(where, "must be an object")
    allowed = {"point", "layer", "positions"} | ({"vector", "scale", "function", "args"} if kind == "add" else set())
    unknown = sorted(set(e) - allowed)
    if unknown:
        _bad(f"{where}.{unknown[0]}", f"is not a field of a {kind} entry")
    point = e.get("point")
    if point not in POINTS:
        _bad(f"{where}.point", f"must be one of {', '.join(POINTS)}")
    layer = _int(e.get("layer"), f"{where}.layer")
    start, stop = 0, None
    pos = e.get("positions")
    if pos is not None:
        if not isinstance(pos, (list, tuple)) or len(pos) != 2:
            _bad(f"{where}.positions", "must be [start, stop) (stop may be null)")
        start = _int(pos[0], f"{where}.positions")
        stop = None if pos[1] is None else _int(pos[1], f"{where}.positions")
        if stop is not None and stop <= start:
            _bad(f"{where}.positions", "stop must be above start")
    if kind == "capture":
        return Hook(point, layer, start, stop, True)
    vector, function = e.get("vector"), e.get("function")
    if (vector is None) == (function is None):
        _bad(where, "an add takes exactly one of 'vector' and 'function'")
    scale = e.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _bad(f"{where}.scale", "must be a finite number")
    if function is not None:
        if not isinstance(function, str) or not function:
            _bad(f"{where}.function", "must be the name of a registered activation function")
        args = e.get("args")
        if args is not None and not isinstance(args, dict):
            _bad(f"{where}.args", "must be an object")
        return Hook(point, layer, start, stop, False, None, function, args)
    try:
        vec = np.asarray(vector, dtype=np.float64)
    except (TypeError, ValueError):
        vec = None
    if vec is None or vec.ndim != 1 or not 0 < vec.size <= MAX_VECTOR or not np.isfinite(vec).all():
        _bad(f"{where}.vector", f"must be a list of 1 to {MAX_VECTOR} finite numbers")
    return Hook(point, layer, start, stop, False, (vec * float(scale)).astype(np.float32))


def to_plain(value: Any) -> Any:
    """``SamplingParams.activations`` as plain data (lists, not numpy), what crosses msgpack."""
    if not isinstance(value, dict):
        return value
    out = {}
    for kind, entries in value.items():
        if isinstance(entries, (list, tuple)):
            entries = [{k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in e.items()}
                       if isinstance(e, dict) else e for e in entries]
        out[kind] = entries
    return out


def check(spec: ActivationSpec | None, shape: Any, functions: Callable[[str], Any] | None = None) -> None:
    """A request's hooks against the engine's model (``shape``, its
    ``ModelShape``): the model runs hooks, each layer exists, each vector
    has the model's hidden size (when its ``cfg`` says), each function is
    registered (``functions(name)`` raises for one that is not). ValueError
    naming the field."""
    if spec is None:
        return
    if not shape.supports_activation_hooks:
        _bad("", "the model does not run activation hooks (Model.supports_activation_hooks)")
    num_layers = shape.num_layers
    hidden = getattr(shape.cfg, "hidden_size", None)          # the model's own config: hidden_size is optional
    for h in spec.hooks:
        if num_layers is not None and h.layer >= num_layers:
            _bad("", f"layer {h.layer} does not exist (the model has {num_layers} layers: 0 to {num_layers - 1})")
        if h.vector is not None and hidden is not None and h.vector.size != hidden:
            _bad("", f"a {h.point} vector at layer {h.layer} has {h.vector.size} numbers; "
                     f"the model's hidden size is {hidden}")
        if h.function is not None and functions is not None:
            try:
                functions(h.function)
            except Exception:
                _bad("", f"activation function {h.function!r} is not registered "
                         "(fdx_register_activation_functions)")


def check_http_bounds(value: Any) -> None:
    """What an HTTP request may capture: each capture a closed position range,
    at most MAX_HTTP_CAPTURE_POSITIONS positions over all of them."""
    spec = parse(value)
    total = 0
    for i, h in enumerate(h for h in spec.hooks if h.capture):
        if h.stop is None:
            raise ValueError(f"activations.capture[{i}].positions: over HTTP a capture names a closed range "
                             f"[start, stop) (at most {MAX_HTTP_CAPTURE_POSITIONS} positions in all)")
        total += h.stop - h.start
        if total > MAX_HTTP_CAPTURE_POSITIONS:
            raise ValueError(f"activations.capture[{i}].positions: the captures cover more than "
                             f"{MAX_HTTP_CAPTURE_POSITIONS} positions in all (the response size limit)")


# --- in the forward ---------------------------------------------------------------

@dataclass(slots=True, eq=False)
class _Span:
    request_id: str
    a: int                           # rows [a, b) of the step
    b: int
    first_position: int
    hook: Hook


class StepActivations:
    """The step's hooks, by (point, layer): built by the runner from the
    layout when a request has any. The model calls ``apply`` at each point
    (or ``apply_residual`` after a layer); ``captured`` collects what the
    capture hooks took, by request id."""

    def __init__(self, layout: "BatchLayout", functions: Callable[[str], Callable] | None = None):
        self.functions = functions
        self.spans: dict[tuple[str, int], list[_Span]] = {}
        self.request_spans: dict[int, list[tuple[int, int]]] = {}   # layer -> rows of requests hooked
                                                                     # at attn_out / mlp_out there
        for rid, r0, n, p0, args in zip(layout.request_ids, layout.row_starts, layout.num_rows,
                                        layout.start_positions, layout.model_args):
            spec = getattr(args, "activations", None)       # a ModelArgs entry (core/interfaces.py)
            if not isinstance(spec, ActivationSpec):
                continue
            for h in spec.hooks:
                lo, hi = max(h.start, p0), p0 + n if h.stop is None else min(h.stop, p0 + n)
                if lo >= hi:
                    continue
                self.spans.setdefault((h.point, h.layer), []).append(_Span(rid, r0 + lo - p0, r0 + hi - p0, lo, h))
                if h.point != "residual":
                    rows = self.request_spans.setdefault(h.layer, [])
                    if (r0, r0 + n) not in rows:
                        rows.append((r0, r0 + n))
        self.layers = sorted({layer for _, layer in self.spans})
        self.captured: dict[str, list[ActivationCapture]] = {}

    def __bool__(self) -> bool:
        return bool(self.spans)

    def hooked(self, layer: int) -> bool:
        return any((p, layer) in self.spans for p in POINTS)

    def inside(self, layer: int) -> list[tuple[int, int]]:
        """Rows (spans, sorted) of the requests with an attn_out or mlp_out
        hook at ``layer``: the ones that run that layer composed."""
        return sorted(self.request_spans.get(layer, []))

    def apply(self, point: str, layer: int, x):
        """``x`` [rows, hidden] with the adds at (point, layer) applied to
        their requests' rows only; captures taken after them."""
        spans = self.spans.get((point, layer))
        if not spans:
            return x
        for s in spans:
            if not s.hook.capture:
                x = _splice(x, s.a, s.b, self._add(s, x[s.a:s.b]))
        for s in spans:
            if s.hook.capture:
                self._take(s, x[s.a:s.b])
        return x

    def apply_residual(self, layer: int, out, residual):
        """The residual stream after ``layer`` carried as (layer output,
        residual before it: the stream is their sum): adds go into the
        output's rows, captures take the sum."""
        spans = self.spans.get(("residual", layer))
        if not spans:
            return out
        for s in spans:
            if s.hook.capture:
                continue
            if s.hook.vector is not None:       # the stream is out + residual: add to out
                out = _splice(out, s.a, s.b, self._add(s, out[s.a:s.b]))
            else:                               # a function sees the stream and returns the new one
                stream = out[s.a:s.b] + residual[s.a:s.b]
                out = _splice(out, s.a, s.b, self._add(s, stream) - residual[s.a:s.b])
        for s in spans:
            if s.hook.capture:
                self._take(s, out[s.a:s.b] + residual[s.a:s.b])
        return out

    def _add(self, s: _Span, rows):
        import paddle
        h = s.hook
        if h.vector is not None:
            return rows + paddle.to_tensor(h.vector, dtype=rows.dtype)
        fn = self.functions(h.function)
        got = fn(h.layer, list(range(s.first_position, s.first_position + s.b - s.a)), rows, dict(h.args or {}))
        if tuple(got.shape) != tuple(rows.shape):
            raise ValueError(f"activation function {h.function!r} returned shape {list(got.shape)} "
                             f"for rows of shape {list(rows.shape)}")
        return got.astype(rows.dtype)

    def _take(self, s: _Span, rows) -> None:
        values = np.ascontiguousarray(rows.astype("float32").numpy())
        self.captured.setdefault(s.request_id, []).append(ActivationCapture(
            s.hook.point, s.hook.layer, list(range(s.first_position, s.first_position + s.b - s.a)),
            int(values.shape[1]), values.tobytes()))


def _splice(x, a: int, b: int, rows):
    """``x`` with rows [a, b) replaced (a copy: every other row keeps its bits)."""
    import paddle
    parts = [p for p in (x[:a], rows, x[b:]) if p.shape[0]]
    return paddle.concat(parts, axis=0) if len(parts) > 1 else parts[0]


def merge_rows(x, composed, spans: list[tuple[int, int]]):
    """Rows of ``composed`` where ``spans`` say, the rest from ``x``."""
    import paddle
    parts, at = [], 0
    for a, b in spans:
        if a > at:
            parts.append(x[at:a])
        parts.append(composed[a:b])
        at = b
    if at < x.shape[0]:
        parts.append(x[at:])
    return paddle.concat(parts, axis=0) if len(parts) > 1 else parts[0]


# --- on the request ----------------------------------------------------------------

def keep(store: dict | None, captures: list[ActivationCapture]) -> dict:
    """Add a step's captures to a request's store {"point.layer": {position: row}}:
    a position computed again (after a preemption) replaces its row."""
    store = {} if store is None else store
    for c in captures:
        rows = c.array()
        slot = store.setdefault(f"{c.point}.{c.layer}", {})
        for i, pos in enumerate(c.positions):
            slot[pos] = rows[i]
    return store


@dataclass(slots=True)
class Captured:
    """What one capture hook took over a request: ``values[i]`` is the
    activation at token position ``positions[i]`` (float32 [n, hidden])."""
    positions: list[int]
    values: np.ndarray


def collect(store: dict | None) -> dict[str, Captured] | None:
    """A request's captures as {"point.layer": Captured}, in position order."""
    if not store:
        return None
    out = {}
    for key, rows in store.items():
        positions = sorted(rows)
        out[key] = Captured(positions, np.stack([rows[p] for p in positions]).astype(np.float32))
    return out
