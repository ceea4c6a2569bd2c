"""Guided decoding as an engine service (as vLLM's StructuredOutputManager):
which constraint a request carries, the compile service (thread pools and a
cache keyed by (backend, kind, text)), each constrained request's matcher,
the admission rule that keeps a request waiting until its grammar is
compiled, and the per-step token bitmask.

One ``GuidedDecoding`` per engine, in the engine process: the only place a
grammar compiles (the server's API process compiles nothing; it waits for
the engine's verdict before a response starts). Each step the engine asks
it for the step's bitmask (``step_bitmask``): it advances the matchers of
the scheduled constrained requests by the tokens they sampled since, and
fills one bitmask row for each that samples this step. The bitmask travels
in ``SchedulerOutput.guided`` (plain data), so whichever process samples,
a tensor parallel rank included, masks the logits with ``apply_bitmask``.
No registry keyed by object ids: the runner needs nothing but the step.

Bounds (docs/security.md): a compile that is not done ``compile_timeout_s``
after its request arrived rejects the request (408); a compile whose last
waiting request left (aborted, client gone, timed out) is cancelled if it
has not started; at most ``max_compiles`` distinct constraints compile (or
wait to) at once among those over ``FAST_LANE_CHARS`` characters, past
that a request is refused (429); a constraint of at most ``FAST_LANE_CHARS``
characters compiles on a thread of its own, so large compiles never queue
(or refuse) a small one.

The backends (``GuidedBackend``, core/interfaces.py) are plugins, chosen by
``decoding.guided_backend``.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from fdx.core.config import ConfigError, plugin_settings
from fdx.core.interfaces import AdmissionRule, BuildContext, GuidedBackend, GuidedStep
from fdx.core.sampling_params import SamplingParams

log = logging.getLogger("fdx.guided")
# how to install the backends' packages (named in the errors when one is missing)
INSTALL_HINT = 'pip install "fdx[guided]"'
FAST_LANE_CHARS = 4096      # constraints up to this size compile on their own thread


class GuidedRefused(ValueError):
    """A constrained request the service will not take now (``status``: the
    HTTP status the server answers with: 408 a compile timed out, 429 too
    many compiles in flight)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


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


class _Entry:
    """One constrained request in the engine: its compile, then its matcher."""
    __slots__ = ("key", "future", "deadline", "matcher", "accepted", "done", "ready", "starts_after", "scanned")

    def __init__(self, key: tuple, future: Future, deadline: float, starts_after: list[int] | None = None):
        self.key, self.future, self.deadline = key, future, deadline
        self.starts_after = tuple(starts_after) if starts_after else None   # None: enforced from the start
        self.scanned = 0                # output tokens searched for starts_after
        self.matcher = None             # built when the compile is done
        self.accepted = 0               # output tokens the matcher has accepted
        self.done = False               # eos only from now on (terminated, or a token it refused)
        self.ready = False              # compiled and its matcher built: it may be scheduled


# ``decoding.guided_backend: auto`` takes the first of these that is registered and installed
AUTO_ORDER = ("llguidance", "xgrammar")


def auto_backend(plugins) -> str | None:
    """The backend ``auto`` means here: the first of AUTO_ORDER registered and
    importable (llguidance is an install dependency of fdx), else None (off,
    logged)."""
    for name in AUTO_ORDER:
        if name not in plugins.names("guided_backend"):
            continue
        cls = plugins.get("guided_backend", name)
        if all(importlib.util.find_spec(m) is not None for m in cls.requires):
            return name
    log.info("guided decoding off: decoding.guided_backend is auto and neither llguidance nor xgrammar is "
             "installed (%s)", INSTALL_HINT)
    return None


class GuidedDecoding:
    """The guided service for one model and one backend (``None``: guided
    decoding is off, and a constrained request is refused)."""

    def __init__(self, name: str | None, backend_cls: type[GuidedBackend] | None, tokenizer: Any,
                 vocab_size: int, eos_token_ids, settings: dict | None = None,
                 compile_timeout_s: float | None = None, max_compiles: int | None = None,
                 config: Any = None, plugins: Any = None):
        settings = dict(settings or {})
        self.config, self.plugins = config, plugins         # for the backend's BuildContext
        self.name = name
        self.backend_cls = backend_cls
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        if backend_cls is not None:      # validated into its Settings (a GuidedSettings), as every kind's
            settings = plugin_settings("guided_backend", name or "", backend_cls, settings)
        if isinstance(settings, dict):   # no Settings: the older form, its keys listed in setting_keys
            threads = settings.pop("compile_threads", 2)
            cache_size = settings.pop("cache_size", 512)
            known = backend_cls.setting_keys if backend_cls is not None else tuple(settings)   # off: nothing to check
            unknown = sorted(set(settings) - set(known))
            if unknown:
                raise ConfigError(f"config key 'plugins.guided_backend.{name}.{unknown[0]}': unknown setting; "
                                  f"known: {', '.join([*known, 'compile_threads', 'cache_size'])}")
        else:
            threads, cache_size = settings.compile_threads, settings.cache_size
        for key, value in (("compile_threads", threads), ("cache_size", cache_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"config key 'plugins.guided_backend.{name}.{key}' must be an integer >= 1")
        self.settings = settings
        self.cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self.max_compiles = max_compiles
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._waiters: dict[tuple, int] = {}             # key -> requests waiting for its compile
        self._lock = threading.Lock()
        self._backend: GuidedBackend | None = None
        self._backend_lock = threading.Lock()
        on = backend_cls is not None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fdx-guided") if on else None
        self._fast = ThreadPoolExecutor(1, thread_name_prefix="fdx-guided-fast") if on else None
        self.compile_times: dict[tuple, float] = {}     # key -> seconds the compile took (cold)
        self.counts = {"compiles_started": 0, "compiles_cancelled": 0, "compiles_timed_out": 0,
                       "compiles_refused": 0}
        self.entries: dict[str, _Entry] = {}            # request id -> its compile / matcher
        self.words = (vocab_size + 31) // 32
        eos = np.asarray(self.eos_token_ids, dtype=np.int64)
        self._eos_row = np.zeros(self.words, dtype=np.int32)
        if eos.size:
            np.bitwise_or.at(self._eos_row, eos // 32, (np.int64(1) << (eos % 32)).astype(np.uint32).view(np.int32))
        if backend_cls is not None:
            missing = [m for m in backend_cls.requires if importlib.util.find_spec(m) is None]
            if missing:
                raise ConfigError(f"config key 'decoding.guided_backend': the {name} backend needs the "
                                  f"{', '.join(missing)} package; install it with {INSTALL_HINT} "
                                  f"(or pip install {' '.join(missing)})")

    @classmethod
    def from_config(cls, config, plugins, tokenizer, vocab_size: int, eos_token_ids,
                    warm_up: bool = True) -> "GuidedDecoding":
        name = config.decoding.guided_backend
        named = name not in ("auto", "none", None)   # auto builds its backend at the first guided request
        if name == "auto":
            name = auto_backend(plugins)
        elif name == "none":          # off, as null
            name = None
        backend_cls = None
        if name:
            from fdx.core.plugins import PluginError
            try:
                backend_cls = plugins.get("guided_backend", name)
            except PluginError as e:
                raise ConfigError(f"config key 'decoding.guided_backend': {e}") from None
        settings = (config.plugins.get("guided_backend", {}) or {}).get(name or "", {}) or {}
        sc = config.server
        service = cls(name, backend_cls, tokenizer, vocab_size, eos_token_ids, settings,
                      compile_timeout_s=sc.guided_compile_timeout_s, max_compiles=sc.max_guided_compiles,
                      config=config, plugins=plugins)
        if warm_up and named and backend_cls is not None:
            service._pool.submit(service.backend_or_error)      # import and build off the step loop
        return service

    def admission_rules(self, config) -> list[AdmissionRule]:
        """The always-on guided admission rule, when a backend is set."""
        return [GuidedAdmission(None, BuildContext(config), guided=self)] if self.enabled else []

    @property
    def enabled(self) -> bool:
        return self.backend_cls is not None

    def backend_or_error(self) -> GuidedBackend:
        with self._backend_lock:
            if self._backend is None:
                try:
                    from fdx.core.plugins import make_plugin
                    self._backend = make_plugin(BuildContext(
                        self.config, self.plugins, "guided_backend", self.name or "", tokenizer=self.tokenizer,
                        vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids),
                        "decoding.guided_backend", self.settings, self.backend_cls)
                except ImportError as e:
                    raise ValueError(f"guided decoding backend {self.name!r} cannot load: {e}; "
                                     f"install it with {INSTALL_HINT}") from None
            return self._backend

    @property
    def backend(self) -> GuidedBackend:
        return self.backend_or_error()

    # -- compiles -----------------------------------------------------------------
    def check(self, params: SamplingParams) -> tuple[str, str] | None:
        """The request's constraint, if the service can compile its kind
        (ValueError naming the field otherwise). Compiles nothing."""
        c = constraint_of(params)
        if c is None:
            return None
        field_name = FIELD_OF_KIND[c[0]]
        if not self.enabled:
            raise ValueError(f"invalid sampling parameter {field_name}: guided decoding is off on this "
                             "engine (decoding.guided_backend is null, or auto found no backend installed); set "
                             "decoding.guided_backend to llguidance or xgrammar")
        kinds = self.backend_cls.kinds
        if c[0] not in kinds:
            raise ValueError(f"invalid sampling parameter {field_name}: the {self.name} guided backend "
                             f"does not support {c[0]} constraints (it supports {', '.join(kinds)})"
                             + ("; xgrammar does" if c[0] == "structural_tag" and self.name != "xgrammar"
                                else ""))
        return c

    def _key(self, params: SamplingParams) -> tuple | None:
        c = self.check(params)
        return None if c is None else (self.name, c[0], c[1], params.guided_whitespace_flexible)

    def submit(self, params: SamplingParams, wait: bool = False) -> Future | None:
        """Start (or find) the compile of the request's constraint; None
        when it has none. Raises ValueError for what ``check`` refuses and
        for a constraint whose compile already failed, GuidedRefused when
        ``max_compiles`` are in flight. ``wait``: count one more request
        waiting for it (``release`` uncounts it)."""
        key = self._key(params)
        return None if key is None else self._submit_key(key, wait)

    def _submit_key(self, key: tuple, wait: bool = False) -> Future:
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and fut.cancelled():
                fut = None
            if fut is not None:
                self._cache.move_to_end(key)
            else:
                small = len(key[2]) <= FAST_LANE_CHARS
                busy = 0 if small else sum(not f.done() for k, f in self._cache.items() if len(k[2]) > FAST_LANE_CHARS)
                if self.max_compiles is not None and busy >= self.max_compiles:
                    self.counts["compiles_refused"] += 1
                    raise GuidedRefused(f"{busy} large guided constraints are compiling "
                                        f"(server.max_guided_compiles={self.max_compiles}); retry later", 429)
                pool = self._fast if small else self._pool
                fut = pool.submit(self._compile, key)
                self._cache[key] = fut
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
            if wait:
                self._waiters[key] = self._waiters.get(key, 0) + 1
        if fut.done() and fut.exception() is not None:
            if wait:
                self._release_key(key)
            raise fut.exception()
        return fut

    def _release_key(self, key: tuple) -> None:
        """One request less waits for ``key``'s compile; the last one gone
        cancels it if it has not started (a started compile runs to its end:
        neither backend can be interrupted; the size limits bound it)."""
        with self._lock:
            n = self._waiters.get(key, 0) - 1
            if n > 0:
                self._waiters[key] = n
                return
            self._waiters.pop(key, None)
            fut = self._cache.get(key)
            if fut is not None and not fut.done() and fut.cancel():
                del self._cache[key]
                self.counts["compiles_cancelled"] += 1

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
        it (at most ``timeout``, default ``compile_timeout_s``); raises
        ValueError with the compiler's message, GuidedRefused on a timeout."""
        fut = self.submit(params)
        if fut is None:
            return None
        timeout = self.compile_timeout_s if timeout is None else timeout
        try:
            return fut.result(timeout)
        except TimeoutError:
            self.counts["compiles_timed_out"] += 1
            raise GuidedRefused(self._timeout_message_of(self._key(params)), 408) from None

    def _compile(self, key: tuple) -> Any:
        _, kind, spec, flexible = key
        self.counts["compiles_started"] += 1
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
        for pool in (self._pool, self._fast):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    # -- the engine's constrained requests ------------------------------------------
    def add(self, request_id: str, params: SamplingParams, now: float | None = None) -> bool:
        """Track a request (compile started or found); False if it has no
        constraint. Raises as ``submit`` does."""
        key = self._key(params)
        if key is None:
            return False
        fut = self.submit(params, wait=True)
        now = time.monotonic() if now is None else now
        timeout = self.compile_timeout_s
        self.entries[request_id] = _Entry(key, fut, now + timeout if timeout is not None else float("inf"),
                                          params.guided_starts_after)
        return True

    def remove(self, request_id: str) -> None:
        """The request left (finished, aborted, rejected): drop its matcher,
        and its claim on a compile still running."""
        e = self.entries.pop(request_id, None)
        if e is not None and not e.ready:
            self._release_key(e.key)

    def poll(self, now: float | None = None) -> tuple[list[str], list[tuple[str, str, int]]]:
        """Before each schedule: (requests whose compile is now done and
        which may run, [(request id, error, HTTP status)] of those whose
        compile failed or timed out; the engine rejects those)."""
        ready, failed = [], []
        now = time.monotonic() if now is None else now
        for rid, e in list(self.entries.items()):
            if e.ready:
                continue
            if e.future.cancelled():        # evicted and cancelled under it: compile again
                try:
                    e.future = self._submit_key(e.key)
                except ValueError as err:
                    failed.append((rid, str(err), getattr(err, "status", 400)))
                    continue
            if e.future.done():
                try:
                    compiled = e.future.result()
                    e.matcher = self.backend.matcher(compiled)
                except ValueError as err:
                    failed.append((rid, str(err), getattr(err, "status", 400)))
                    continue
                e.ready = True
                self._release_key(e.key)
                ready.append(rid)
            elif now >= e.deadline:
                self.counts["compiles_timed_out"] += 1
                failed.append((rid, self._timeout_message_of(e.key), 408))
        for rid, _, _ in failed:
            self.remove(rid)
        return ready, failed

    def _timeout_message_of(self, key: tuple) -> str:
        return (f"invalid sampling parameter {FIELD_OF_KIND[key[1]]}: the guided constraint did not compile in "
                f"{self.compile_timeout_s:g} s (server.guided_compile_timeout_s)")

    def is_ready(self, request_id: str) -> bool:
        e = self.entries.get(request_id)
        return e is None or e.ready

    def step_bitmask(self, rows: list[tuple[str, list[int]]],
                     drafts: dict[str, list[int]] | None = None) -> GuidedStep | None:
        """The step's bitmask for the constrained ``rows`` that sample this
        step ((request id, its output token ids so far)): each matcher first
        accepts the tokens sampled since it last looked; a terminated one
        allows eos only (the request ends with "stop", or at max_tokens).

        A request with speculative ``drafts`` (ids ``check_drafts`` let
        through) gets one row per verified position, in order: the mask
        after its output, then after each draft, the matcher advanced
        through the drafts to fill them and rolled back after, so it has
        accepted only the output (the tokens kept are accepted next step)."""
        rows = [(rid, out) for rid, out in rows if rid in self.entries and self.entries[rid].ready]
        if not rows:
            return None
        drafts = drafts or {}
        ids = [rid for rid, _ in rows for _ in range(1 + len(drafts.get(rid, ())))]
        bitmask = np.zeros((len(ids), self.words), dtype=np.int32)
        j = 0
        for rid, out in rows:
            e = self.entries[rid]
            d = drafts.get(rid, ())
            if e.starts_after is not None and not self._started(e, out):
                bitmask[j:j + 1 + len(d)] = -1  # free text until the constraint starts (check_drafts: no drafts)
                j += 1 + len(d)
                continue
            self._advance(e, out)
            done, taken = e.done, 0
            valid = e.matcher.validate_tokens(d) if d and not done else 0
            for i in range(len(d) + 1):
                if done:
                    bitmask[j] = self._eos_row
                else:
                    e.matcher.fill_bitmask(bitmask, j)
                j += 1
                if i < len(d):
                    if done or i >= valid or not e.matcher.accept_token(int(d[i])):
                        # the refused draft ``check_drafts`` keeps for drafts with probabilities: it is
                        # rejected for sure (the mask gives it no mass), so the rows after it are never used
                        bitmask[j:j + len(d) - i] = -1
                        j += len(d) - i
                        break
                    taken += 1
                    done = e.matcher.is_terminated()
            if taken:
                e.matcher.rollback(taken)
        return GuidedStep(ids, bitmask.tobytes())

    def check_drafts(self, request_id: str, out: list[int], drafts: list[int],
                     keep_refused: bool = False) -> list[int]:
        """The longest prefix of a constrained request's speculative
        ``drafts`` its grammar allows after ``out`` (its output so far);
        the rest is dropped before it is scored. The matcher ends where it
        was (after ``out``): each draft it took is rolled back. No drafts
        while the constraint waits for ``starts_after`` or has terminated,
        and none past a draft that terminates it.

        ``keep_refused`` (drafts drawn with probabilities): the first
        refused draft stays, to be rejected by rejection sampling (the
        masked target gives it no mass, and the replacement is drawn from
        the residual): cutting a draft because of its own value would bias
        the output distribution. Deterministic drafts are cut before it
        (their replacement is the target's own sample either way)."""
        e = self.entries.get(request_id)
        if e is None:
            return drafts
        if not e.ready or not drafts or (e.starts_after is not None and not self._started(e, out)):
            return []
        self._advance(e, out)
        if e.done:
            return []
        valid = e.matcher.validate_tokens(drafts)
        taken = 0
        for t in drafts[:valid]:                 # accepted again: a draft that terminates ends the drafts
            if not e.matcher.accept_token(int(t)):
                break
            taken += 1
            if e.matcher.is_terminated():
                break
        if taken:
            e.matcher.rollback(taken)
        refused = taken == valid < len(drafts)
        return drafts[:taken + int(refused and keep_refused)]

    @staticmethod
    def _started(e: _Entry, out: list[int]) -> bool:
        """Has the output reached ``starts_after``? Once it has, the matcher
        takes the tokens after it (``accepted`` starts there)."""
        seq, n = e.starts_after, len(e.starts_after)
        for i in range(max(0, e.scanned - n + 1), len(out) - n + 1):
            if tuple(out[i:i + n]) == seq:
                e.starts_after, e.accepted = None, i + n
                return True
        e.scanned = len(out)
        return False

    @staticmethod
    def _advance(e: _Entry, out: list[int]) -> None:
        while e.accepted < len(out):
            token = out[e.accepted]
            e.accepted += 1
            if e.done:
                continue
            if not e.matcher.accept_token(int(token)) or e.matcher.is_terminated():
                e.done = True           # e.g. ignore_eos sampling past the end: eos only from now on


class GuidedAdmission(AdmissionRule):
    """Keeps a constrained request waiting (skipped, not blocking the
    queue) until its grammar's compile is done and its matcher built;
    always on when a guided backend is configured. A failed compile never
    runs: the engine rejects the request when ``poll`` reports it."""

    def __init__(self, settings: dict | None = None, context: BuildContext | None = None, *,
                 guided: GuidedDecoding | None = None):
        super().__init__(settings, context)
        self.guided = guided

    def admit(self, request, state) -> bool:
        params = request.sampling_params
        if self.guided is None or constraint_of(params) is None:
            return True
        if getattr(request, "request_id", None) in self.guided.entries:   # an engine request: compiled, matched
            return self.guided.is_ready(request.request_id)
        fut = self.guided.future(params)
        return fut is None or fut.done()


def apply_guided(logits: np.ndarray, step: GuidedStep, row_of: dict[str, int | list[int]],
                 eos_token_ids) -> np.ndarray:
    """Mask the sampling rows of ``logits`` (``row_of``: request id -> row,
    or a speculated request's rows, one per verified position: the n-th
    bitmask row of a request masks its n-th row) with the step's bitmask;
    a row left with nothing (another processor banned all the grammar
    allows) gets its eos ids back, so it can end."""
    pairs, seen = [], {}
    for j, rid in enumerate(step.request_ids):
        r = row_of.get(rid)
        if r is None:
            continue
        if isinstance(r, int):
            pairs.append((j, r))
            continue
        n = seen[rid] = seen.get(rid, -1) + 1
        if n < len(r):
            pairs.append((j, r[n]))
    if not pairs:
        return logits
    words = np.frombuffer(step.bitmask, dtype=np.int32).reshape(len(step.request_ids), -1)
    idx = [i for _, i in pairs]
    apply_bitmask(logits, words[[j for j, _ in pairs]], idx)
    eos = np.asarray(sorted(eos_token_ids), dtype=np.int64)
    if eos.size:
        dead = np.isneginf(logits[idx]).all(axis=1)
        for j in np.flatnonzero(dead):
            logits[idx[j], eos] = 0.0
    return logits


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
