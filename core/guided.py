"""Guided decoding's core side: which constraint a request carries, the
compile service (a thread pool and a cache keyed by (backend, kind, text)),
the admission rule that keeps a request waiting until its grammar is
compiled, and the vectorized bitmask apply.

The backends (``GuidedBackend``, core/interfaces.py) are plugins, chosen by
``decoding.guided_backend``; the built-in ``guided`` logits processor
(plugins/decoding/guided.py) runs the matchers. One ``GuidedDecoding`` is
built per engine (and one in the server's API process, which compiles to
validate a request before its response starts).
"""
from __future__ import annotations

import importlib.util
import json
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fdx.core.config import ConfigError
from fdx.core.interfaces import GUIDED_KINDS, AdmissionRule, GuidedBackend
from fdx.core.sampling_params import SamplingParams

# how to install the backends' packages (named in the errors when one is missing)
INSTALL_HINT = 'pip install "fdx[guided]"'


def constraint_of(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, spec text) of the request's constraint, or None. JSON is
    re-serialized compactly (key order kept: it is the output order), so
    equal constraints share one compile."""
    def canon(value) -> str:
        if isinstance(value, str):
            value = json.loads(value)
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)

    if params.guided_json is not None:
        return "json", canon(params.guided_json)
    if params.guided_json_object:
        return "json_object", ""
    if params.guided_regex is not None:
        return "regex", params.guided_regex
    if params.guided_choice is not None:
        return "choice", json.dumps(params.guided_choice, ensure_ascii=False)
    if params.guided_grammar is not None:
        return "grammar", params.guided_grammar
    if params.structural_tag is not None:
        return "structural_tag", canon(params.structural_tag)
    return None


FIELD_OF_KIND = {"json": "guided_json", "json_object": "guided_json_object", "regex": "guided_regex",
                 "choice": "guided_choice", "grammar": "guided_grammar", "structural_tag": "structural_tag"}


class GuidedDecoding:
    """The compile service for one model and one backend (``None``: guided
    decoding is off, and a constrained request is refused)."""

    _by_tokenizer: "weakref.WeakValueDictionary[int, GuidedDecoding]" = weakref.WeakValueDictionary()

    def __init__(self, name: str | None, backend_cls: type[GuidedBackend] | None, tokenizer: Any,
                 vocab_size: int, eos_token_ids, settings: dict | None = None):
        settings = dict(settings or {})
        self.name = name
        self.backend_cls = backend_cls
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        threads = settings.pop("compile_threads", 2)
        cache_size = settings.pop("cache_size", 512)
        for key, value in (("compile_threads", threads), ("cache_size", cache_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config key 'plugins.guided_backend.{name}.{key}' must be an integer >= 1")
        unknown = sorted(set(settings) - set(getattr(backend_cls, "setting_keys", settings)))
        if unknown:
            raise ConfigError(f"config key 'plugins.guided_backend.{name}.{unknown[0]}': unknown setting; "
                              f"known: {', '.join([*getattr(backend_cls, 'setting_keys', ()), 'compile_threads', 'cache_size'])}")
        self.settings = settings
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._backend: GuidedBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fdx-guided") if backend_cls else None
        self.compile_times: dict[tuple, float] = {}     # key -> seconds the compile took (cold)
        if backend_cls is not None:
            missing = [m for m in getattr(backend_cls, "requires", ()) if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(f"config key 'decoding.guided_backend': the {name} backend needs the "
                                  f"{', '.join(missing)} package; install it with {INSTALL_HINT} "
                                  f"(or pip install {' '.join(missing)})")

    @classmethod
    def from_config(cls, config, plugins, tokenizer, vocab_size: int, eos_token_ids,
                    warm_up: bool = True) -> "GuidedDecoding":
        name = config.decoding.guided_backend
        backend_cls = None
        if name:
            from fdx.core.plugins import PluginError
            try:
                backend_cls = plugins.get("guided_backend", name)
            except PluginError as e:
                raise ConfigError(f"config key 'decoding.guided_backend': {e}") from None
        settings = (config.plugins.get("guided_backend", {}) or {}).get(name or "", {}) or {}
        service = cls(name, backend_cls, tokenizer, vocab_size, eos_token_ids, settings)
        cls._by_tokenizer[id(tokenizer)] = service
        if warm_up and backend_cls is not None:
            service._pool.submit(service.backend_or_error)      # import and build off the step loop
        return service

    @classmethod
    def of(cls, tokenizer) -> "GuidedDecoding | None":
        """The service the engine built for this tokenizer object (the
        guided logits processor, built with the engine's tokenizer, finds it
        so; the service holds the tokenizer, so its id stays unique)."""
        return cls._by_tokenizer.get(id(tokenizer))

    def admission_rules(self, config) -> list[AdmissionRule]:
        """The always-on guided admission rule, when a backend is set."""
        return [GuidedAdmission(config, guided=self)] if self.enabled else []

    @property
    def enabled(self) -> bool:
        return self.backend_cls is not None

    def backend_or_error(self) -> GuidedBackend:
        with self._backend_lock:
            if self._backend is None:
                try:
                    self._backend = self.backend_cls(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                     settings=self.settings)
                except ImportError as e:
                    raise ValueError(f"guided decoding backend {self.name!r} cannot load: {e}; "
                                     f"install it with {INSTALL_HINT}") from None
            return self._backend

    @property
    def backend(self) -> GuidedBackend:
        return self.backend_or_error()

    # -- requests ---------------------------------------------------------------
    def check(self, params: SamplingParams) -> tuple[str, str] | None:
        """The request's constraint, if the service can compile its kind
        (ValueError naming the field otherwise). Compiles nothing."""
        c = constraint_of(params)
        if c is None:
            return None
        field_name = FIELD_OF_KIND[c[0]]
        if not self.enabled:
            raise ValueError(f"invalid sampling parameter {field_name}: guided decoding is off on this "
                             "engine; set decoding.guided_backend to xgrammar or llguidance")
        kinds = getattr(self.backend_cls, "kinds", GUIDED_KINDS)
        if c[0] not in kinds:
            raise ValueError(f"invalid sampling parameter {field_name}: the {self.name} guided backend "
                             f"does not support {c[0]} constraints (it supports {', '.join(kinds)})"
                             + ("; xgrammar does" if c[0] == "structural_tag" and self.name != "xgrammar"
                                else ""))
        return c

    def submit(self, params: SamplingParams) -> Future | None:
        """Start (or find) the compile of the request's constraint; None
        when it has none. Raises ValueError for what ``check`` refuses and
        for a constraint whose compile already failed."""
        c = self.check(params)
        if c is None:
            return None
        key = (self.name, c[0], c[1], params.guided_whitespace_flexible)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
            else:
                fut = self._pool.submit(self._compile, key)
                self._cache[key] = fut
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if fut.done() and fut.exception() is not None:
            raise fut.exception()
        return fut

    def future(self, params: SamplingParams) -> Future | None:
        """The compile of the request's constraint (started if it is not)."""
        try:
            return self.submit(params)
        except ValueError as e:
            fut = Future()
            fut.set_exception(e)
            return fut

    def validate(self, params: SamplingParams, timeout: float | None = None) -> Any:
        """Compile (or find compiled) the request's constraint, waiting for
        it; raises ValueError with the compiler's message."""
        fut = self.submit(params)
        return None if fut is None else fut.result(timeout)

    def _compile(self, key: tuple) -> Any:
        _, kind, spec, flexible = key
        backend = self.backend_or_error()
        t0 = time.perf_counter()
        try:
            compiled = backend.compile(kind, spec, whitespace_flexible=flexible)
        except ValueError as e:
            raise ValueError(f"invalid sampling parameter {FIELD_OF_KIND[kind]}: {e}") from None
        except Exception as e:          # a compiler's own error type: still the user's constraint
            raise ValueError(f"invalid sampling parameter {FIELD_OF_KIND[kind]}: the {self.name} compiler "
                             f"rejected it: {str(e).strip()}") from None
        self.compile_times[key] = time.perf_counter() - t0
        return compiled

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class GuidedAdmission(AdmissionRule):
    """Keeps a constrained request waiting (skipped, not blocking the
    queue) until its grammar's compile is done; always on when a guided
    backend is configured. A failed compile is admitted: the engine
    rejected such a request on arrival, so this is only a race, and the
    guided processor ends it with eos."""

    def __init__(self, config, settings: dict | None = None, guided: GuidedDecoding | None = None):
        super().__init__(config, settings)
        self.guided = guided

    def admit(self, request, state) -> bool:
        params = request.sampling_params
        if self.guided is None or constraint_of(params) is None:
            return True
        fut = self.guided.future(params)
        return fut is None or fut.done()


def apply_bitmask(logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray | list[int]) -> np.ndarray:
    """``logits[rows[i], t] = -inf`` where bit t of ``bitmask[i]`` is clear:
    one vectorized pass over the masked rows (int32 words, little-endian
    bit order, as xgrammar and llguidance fill them)."""
    vocab = logits.shape[1]
    allowed = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    sub = logits[rows]
    sub[allowed == 0] = -np.inf
    logits[rows] = sub
    return logits
