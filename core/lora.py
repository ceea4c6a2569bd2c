"""LoRA adapters per request (docs/lora.md).

A request names its adapter with a ``LoRARequest`` (vLLM's class:
``LLM.generate(..., lora_request=...)``; over HTTP the request's ``model``
field). The engine's ``LoRAManager`` keeps at most ``lora.max_loras``
adapters loaded, through the executor on every rank (``Executor.load_lora``),
evicting the least recently used one no running request uses. On each rank
a ``LoRALoader`` (``lora.lora_loader``; built-in ``peft``) reads the files
into ``LoRAWeights`` (plain float32 numpy), ``check`` holds them against the
model, and the model keeps its shard (``Model.load_lora``).

In the forward, ``StepLoRA`` (built by the runner from the step's
``BatchLayout``) groups the rows of each adapter; after each linear an
adapter targets, the model adds ``x_rows @ A^T @ B^T * scale`` to those rows
only (shrink, then expand, per adapter group, as vLLM's punica_cpu); the
other rows keep their bits. Both products are the runner's
``fdx.ops.dense.lora_matmul``: under backend.batch_invariant the compiled
float32 product at every row count (as the base model's own products then
are), so a row's delta has the same bits whichever rows and adapters share
its step: a request's logits with an adapter are the same alone or in any
batch. Otherwise Paddle's matmul (MKL: faster on a long prompt's rows, its
order depending on the row count, as the base products' is then).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from fdx.core.interfaces import BatchLayout

log = logging.getLogger("fdx.lora")

#: The modules an adapter may target, Hugging Face's names, in every decoder layer.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: an adapter by name, a unique integer id and
    its path (a PEFT folder for the ``peft`` loader). ``base_model_name``:
    the served model it belongs to (``/v1/models`` lists it as the parent)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError("lora_request.lora_int_id must be an integer of at least 1 (vLLM's rule)")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


@dataclass(slots=True)
class LoRAWeights:
    """An adapter as a loader reads it: ``modules[(layer, module)] = (A, B)``,
    float32 ``A [r, in]`` and ``B [out, r]`` (PEFT's lora_A / lora_B
    weights), and ``scale`` (``lora_alpha / r``, or ``/ sqrt(r)`` with
    rsLoRA) applied to every product."""
    rank: int
    scale: float
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    source: str = ""                    # where it came from, for messages

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def check(adapter: Any, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int) -> "LoRAWeights":
    """``adapter`` against the model: known modules and layers, ``A [r, in]``
    and ``B [out, r]`` of each module's shape, rank at most ``max_rank``
    (``lora.max_lora_rank``), finite values. ValueError saying what is wrong."""
    where = f"LoRA adapter {getattr(adapter, 'source', '') or '(unnamed)'}"
    if not isinstance(adapter, LoRAWeights):
        raise ValueError(f"{where}: the loader returned {type(adapter).__name__}, not LoRAWeights")
    if not adapter.modules:
        raise ValueError(f"{where}: targets no module")
    if not isinstance(adapter.rank, int) or adapter.rank < 1:
        raise ValueError(f"{where}: rank {adapter.rank!r} is not a positive integer")
    if adapter.rank > max_rank:
        raise ValueError(f"{where}: rank {adapter.rank} is above lora.max_lora_rank={max_rank} "
                         "(--max-lora-rank)")
    if not np.isfinite(adapter.scale):
        raise ValueError(f"{where}: scale {adapter.scale} is not finite")
    for (layer, module), (a, b) in adapter.modules.items():
        name = f"layer {layer} {module}"
        if module not in shapes:
            raise ValueError(f"{where}: targets {module!r}, which this model does not adapt "
                             f"(supported: {', '.join(shapes)})")
        if not isinstance(layer, int) or not 0 <= layer < num_layers:
            raise ValueError(f"{where}: targets layer {layer}; the model has {num_layers} layers")
        out, inp = shapes[module]
        r = a.shape[0] if np.ndim(a) == 2 else -1
        if np.ndim(a) != 2 or np.ndim(b) != 2 or a.shape != (r, inp) or b.shape != (out, r):
            raise ValueError(f"{where}: {name} has lora_A {list(np.shape(a))} and lora_B {list(np.shape(b))}; "
                             f"the model needs lora_A [r, {inp}] and lora_B [{out}, r]")
        if r > max_rank:
            raise ValueError(f"{where}: {name} has rank {r}, above lora.max_lora_rank={max_rank} "
                             "(--max-lora-rank)")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise ValueError(f"{where}: {name} holds values that are not finite")
    return adapter


def read_adapter(loader: Any, path: str, model: Any, max_rank: int) -> LoRAWeights:
    """The adapter at ``path`` read by ``loader`` and checked against
    ``model`` (what ``Executor.load_lora`` runs on each rank)."""
    if not model.supports_lora:
        raise ValueError(f"{type(model).__name__} does not apply LoRA adapters (Model.supports_lora)")
    adapter = loader.load(path)
    if isinstance(adapter, LoRAWeights) and not adapter.source:
        adapter.source = str(path)
    return check(adapter, model.lora_shapes(), model.num_layers, max_rank)


def make_loader(config: Any, plugins: Any) -> Any:
    """The ``lora.lora_loader`` plugin, constructed with its settings."""
    from fdx.core.plugins import make_plugin
    from fdx.core.config import ConfigError
    from fdx.core.interfaces import BuildContext
    name = config.lora.lora_loader
    try:
        cls = plugins.get("lora_loader", name)
    except Exception:
        raise ConfigError(f"config key 'lora.lora_loader': no LoRA loader named {name!r} "
                          "(fdx_register_lora_loaders)") from None
    return make_plugin(BuildContext(config, plugins, "lora_loader", name), "lora.lora_loader", cls=cls)


# --- in the forward ------------------------------------------------------------------------

class StepLoRA:
    """The step's adapter groups, from the layout: ``groups`` is a list of
    (adapter name, its requests' row spans), in first-row order.
    ``matmul``: the float32 product of the shrink and expand (the runner
    passes fdx.ops.dense.lora_matmul; default Paddle's matmul)."""

    def __init__(self, layout: "BatchLayout", matmul: Callable[[Any, Any], Any] | None = None):
        self.matmul = matmul
        by_name: dict[str, list[tuple[int, int]]] = {}
        for r0, n, args in zip(layout.row_starts, layout.num_rows, layout.model_args):
            name = getattr(args, "lora", None)
            if name is not None and n:
                by_name.setdefault(name, []).append((r0, r0 + n))
        self.groups = list(by_name.items())

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, y, x, held: dict[str, tuple[Any, Any, float]]):
        """``y`` with ``x_rows @ A^T @ B^T * scale`` added to the rows of each
        adapter in ``held`` (name -> (A^T [in, r], B^T [r, out], scale) as
        Paddle tensors): the group's rows are gathered, shrunk and expanded
        once per adapter; every other row of ``y`` keeps its bits."""
        if not held:
            return y
        import paddle
        mm = self.matmul or paddle.matmul
        pieces: list[tuple[int, int, Any]] = []
        for name, spans in self.groups:
            ab = held.get(name)
            if ab is None:
                continue
            a_t, b_t, scale = ab
            xs = x[spans[0][0]:spans[0][1]] if len(spans) == 1 else paddle.concat([x[a:b] for a, b in spans])
            if xs.dtype != a_t.dtype:              # the adapter stays float32 beside any base dtype
                xs = xs.astype(a_t.dtype)
            d = mm(mm(xs, a_t), b_t) * scale
            at = 0
            for a, b in spans:
                pieces.append((a, b, d[at:at + b - a]))
                at += b - a
        if not pieces:
            return y
        pieces.sort(key=lambda p: p[0])
        parts, at = [], 0
        for a, b, d in pieces:
            if a > at:
                parts.append(y[at:a])
            parts.append(y[a:b] + d.astype(y.dtype))
            at = b
        if at < y.shape[0]:
            parts.append(y[at:])
        return paddle.concat(parts, axis=0) if len(parts) > 1 else parts[0]


# --- in the engine ------------------------------------------------------------------------

class LoRAManager:
    """Which adapters the engine knows (name -> LoRARequest) and which are
    loaded on the ranks, at most ``max_loras`` at a time: loading one more
    evicts the least recently used adapter no unfinished request uses, and
    when every slot is in use the request is refused (ValueError)."""

    def __init__(self, config: Any, load: Callable[[str, str], None], unload: Callable[[str], None]):
        self.max_loras = config.lora.max_loras
        self._load, self._unload = load, unload
        self.known: dict[str, LoRARequest] = {}
        self.loaded: OrderedDict[str, int] = OrderedDict()     # name -> its id, least recently used first
        self.users: dict[str, int] = {}                         # name -> unfinished requests using it

    def register(self, req: LoRARequest, load_now: bool = False) -> None:
        """Know ``req`` by its name (``--lora-modules``, /v1/load_lora_adapter).
        ``load_now``: load it on the ranks at once, so a bad adapter is refused
        here (with the reason) and not at its first request."""
        old = self.known.get(req.lora_name)
        if old is not None and (old.lora_path != req.lora_path or old.lora_int_id != req.lora_int_id):
            raise ValueError(f"a LoRA adapter named {req.lora_name!r} is already loaded (from "
                             f"{old.lora_path}); unload it first")
        for other in self.known.values():
            if other.lora_int_id == req.lora_int_id and other.lora_name != req.lora_name:
                raise ValueError(f"lora_int_id {req.lora_int_id} is already {other.lora_name!r}'s")
        if load_now:
            self.acquire(req, use=False)
        self.known[req.lora_name] = req

    def next_id(self) -> int:
        """An id no known adapter has."""
        return max((r.lora_int_id for r in self.known.values()), default=0) + 1

    def unregister(self, name: str) -> None:
        """Forget ``name`` and drop it from the ranks (KeyError when unknown,
        ValueError while a request uses it)."""
        if name not in self.known:
            raise KeyError(name)
        if self.users.get(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by {self.users[name]} unfinished request(s)")
        if name in self.loaded:
            self._unload(name)
            del self.loaded[name]
        del self.known[name]

    def acquire(self, req: LoRARequest, use: bool = True) -> None:
        """Make sure ``req``'s adapter is loaded (evicting if need be) and,
        with ``use``, count one more request on it."""
        name = req.lora_name
        known = self.known.get(name)
        if known is not None and known.lora_path != req.lora_path and req.lora_path:
            raise ValueError(f"lora_request: adapter {name!r} is loaded from {known.lora_path}, "
                             f"not {req.lora_path}")
        if name in self.loaded:
            self.loaded.move_to_end(name)
        else:
            if len(self.loaded) >= self.max_loras:
                idle = [n for n in self.loaded if not self.users.get(n)]
                if not idle:
                    raise ValueError(f"cannot load LoRA adapter {name!r}: all lora.max_loras={self.max_loras} "
                                     "slots hold adapters that unfinished requests use (raise --max-loras, "
                                     "or retry when they finish)")
                self._unload(idle[0])
                del self.loaded[idle[0]]
                log.info("LoRA adapter %s evicted (least recently used) to load %s", idle[0], name)
            path = (known or req).lora_path
            self._load(name, path)
            self.loaded[name] = req.lora_int_id
            log.info("LoRA adapter %s loaded from %s", name, path)
        if known is None:
            self.known[name] = req
        if use:
            self.users[name] = self.users.get(name, 0) + 1

    def release(self, name: str) -> None:
        """One request on ``name`` finished."""
        n = self.users.get(name, 0) - 1
        if n > 0:
            self.users[name] = n
        else:
            self.users.pop(name, None)
