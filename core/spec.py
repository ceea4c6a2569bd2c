"""Speculative decoding: the engine's side of it (docs/speculative.md).

``Speculation`` holds the configured proposer (``speculative.method``, a
``Proposer`` from core/interfaces.py), asks it for drafts while the
scheduler builds a step (``SchedulingCore.schedule_running``), checks what
it returns, tells it what was accepted, and counts (vLLM's
``spec_decode_*`` figures). ``CostGate`` decides, from step times measured
on this machine, at which batch sizes speculation pays.

Verification runs in the model runner (plugins/backends/runner.py): one
forward scores each request's pending token and its drafts; row j of a
request is sampled as a request without speculation would sample its
token j (the same processed logits, the same seeded draw), and the drafts
are kept while they equal those samples. For deterministic drafts that is
exactly rejection sampling (a draft proposed with probability 1 is kept
with the target's probability of it, else the target's distribution
without it is drawn from): the output distribution, and for greedy or
seeded requests the output itself, is the one without speculation.
Drafts with probabilities (``Proposal.draft_probs``) go through
``rejection_sample`` (Leviathan et al. 2023).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from fdx.core.config import ConfigError, FdxConfig
from fdx.core.interfaces import BuildContext, Proposal, Proposer

log = logging.getLogger("fdx.spec")

# SamplingParams fields whose logits processors read the request's output so far: such a request is not
# speculated (its verified rows would need the processors run once per draft position)
_PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias",
                     "allowed_token_ids", "bad_words", "bad_words_token_ids")


class ProposerError(RuntimeError):
    """A proposer broke its contract (more than k drafts, an id outside the vocabulary)."""


def needs_processors(params) -> bool:
    """True when a request's sampling parameters ask for a built-in logits
    processor (penalties, min_tokens, logit_bias, allowed ids, bad words)."""
    defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_tokens": 0}
    for name in _PROCESSOR_FIELDS:
        value = getattr(params, name, None)
        if name in defaults:
            if value is not None and value != defaults[name]:
                return True
        elif value:
            return True
    return False


def opted_out(params) -> bool:
    """The per-request opt-out: ``extra_args={"speculative": False}``."""
    extra = params.extra_args or {}
    return extra.get("speculative", True) is False


def check_proposal(name: str, result: Any, k: int, vocab_size: int) -> tuple[list[int], np.ndarray | None]:
    """A proposer's answer as (token ids, draft probs or None); a
    ``ProposerError`` naming the proposer when it breaks the contract."""
    probs = None
    if isinstance(result, Proposal):
        result, probs = result.token_ids, result.draft_probs
    try:
        ids = [int(t) for t in result]
    except (TypeError, ValueError):
        raise ProposerError(f"proposer {name!r} returned {type(result).__name__}, not a list of token ids") from None
    if len(ids) > k:
        raise ProposerError(f"proposer {name!r} proposed {len(ids)} tokens; at most k={k} may be proposed")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ProposerError(f"proposer {name!r} proposed token id {bad[0]}, outside the vocabulary "
                            f"(0 .. {vocab_size - 1})")
    if probs is not None:
        probs = np.asarray(probs, dtype=np.float32)
        if probs.shape != (len(ids), vocab_size):
            raise ProposerError(f"proposer {name!r} gave draft_probs of shape {probs.shape}; "
                                f"expected ({len(ids)}, {vocab_size})")
    return ids, probs


def accept_sampled(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """Deterministic drafts against the target's samples at each verified
    position (``len(sampled) == len(drafts) + 1``): the drafts up to the
    first that differs from the target's sample there, then the target's
    sample at that position (or, all kept, the bonus one)."""
    out = []
    for d, s in zip(drafts, sampled):
        out.append(int(s))
        if int(s) != int(d):
            return out
    out.append(int(sampled[len(drafts)]))
    return out


def rejection_sample(target: np.ndarray, drafts: Sequence[int], draft_probs: np.ndarray,
                     uniforms: np.ndarray) -> list[int]:
    """Leviathan et al. 2023: ``target`` [m+1, V] the target's distributions
    at each verified position, ``draft_probs`` [m, V] the ones the drafts
    were drawn from, ``uniforms`` [m+1, 2] in [0, 1). Draft j is kept with
    probability min(1, p(d)/q(d)); the first one rejected is replaced by a
    draw from max(0, p - q) normalized; all kept, a bonus token is drawn
    from the last row. The result is distributed as the target samples."""
    out = []
    for j, d in enumerate(drafts):
        p, q = float(target[j, d]), float(draft_probs[j, d])
        if q > 0 and uniforms[j, 0] < min(1.0, p / q):
            out.append(int(d))
            continue
        residual = np.maximum(target[j].astype(np.float64) - draft_probs[j], 0.0)
        if residual.sum() <= 0:                  # p == q: any rejection is impossible in exact arithmetic
            residual = target[j].astype(np.float64)
        out.append(_draw(residual, uniforms[j, 1]))
        return out
    out.append(_draw(target[len(drafts)].astype(np.float64), uniforms[len(drafts), 1]))
    return out


def _draw(weights: np.ndarray, u: float) -> int:
    cum = np.cumsum(weights)
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), len(weights) - 1))


@dataclass(slots=True)
class SpecCounters:
    """Since the engine started (vLLM's spec_decode_* counters)."""
    num_drafts: int = 0                    # requests x steps that verified proposals
    num_draft_tokens: int = 0              # tokens proposed and verified
    num_accepted_tokens: int = 0           # of those, kept
    accepted_per_pos: list[int] = field(default_factory=list)   # kept at draft position 0, 1, ...
    proposed_per_pos: list[int] = field(default_factory=list)   # proposed at draft position 0, 1, ...
    offered_per_pos: list[int] = field(default_factory=list)    # proposals that could reach position 0, 1, ...

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying request gains per step: 1 (the target's own) + accepted."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class CostGate:
    """How many drafts a step's requests may verify (0: none), from this
    machine's own step times and the proposer's acceptance so far.

    Batch sizes fall in power-of-two buckets. In each, decode-only steps are
    timed per decoding request, with and without drafts (medians over the
    last ``window`` of each kind): ``rho``, the cost of a speculated step
    against a plain one, and from it the cost of one draft row per request
    (``beta``, the same for every k': on the Zen 4 about a quarter of a
    plain step at batch 1, where the rows share each weight block's
    decoding but not its arithmetic, and a whole one at a compute-bound
    batch). ``row_threshold`` turns it into the chance of being kept a draft
    row needs to pay (``DraftRecord.cut``). The proposer's record (per draft position: how
    often it proposed a token there, how often that token was kept; and in
    this bucket how many requests get drafts) gives, for each k' <= k, the
    expected drafts ``D(k')`` and accepted tokens ``A(k')`` a request has in
    a step. The gate runs the k' with the best expected gain
    ``(1 + A(k')) / (1 + beta * D(k'))``, or none: it turns on past
    ``1 + margin`` (0 at batch 1, twice ``margin`` from 16 requests, where a
    wrong guess costs most) and off under 0.98, so noise near even does
    not flip it each step. Off, it tries again so that
    the tries cost at most ``explore_cost`` of the steps (and at least every
    ``explore_every`` steps); a bucket of 16 or more requests first tries
    with k' = 1 (a try there costs about one plain step per draft). The
    first steps of a bucket alternate until each kind was timed
    ``min_samples`` times (from 16 requests: twice, or once for a gain
    under 0.6, and ``min_samples`` times while the gain is within 25% of even). Each change between on and off is logged
(a change of k' at debug level). On,
    every ``2 * explore_every``-th step is a plain one (the load may
    change) and, at k' < k, one in ``explore_every`` runs at k, so the
    positions past k' keep being measured (their rates are over the
    proposals that could reach them)."""

    def __init__(self, enabled: bool = True, min_samples: int = 4, explore_every: int = 32, window: int = 16,
                 margin: float = 0.05, explore_cost: float = 0.01):
        self.enabled = enabled
        self.min_samples, self.explore_every, self.window = min_samples, explore_every, window
        self.margin, self.explore_cost = margin, explore_cost
        self.plain: dict[int, list[float]] = {}                         # bucket -> seconds / request
        self.spec: dict[int, list[tuple[float, float, float]]] = {}     # (seconds, drafts, draft tokens) / request
        self.decided: dict[int, int] = {}                               # bucket -> k' (0: off)
        self.since: dict[int, int] = {}                                 # bucket -> steps since the last try
        self.steps: dict[int, int] = {}                                 # bucket -> steps decided
        self.beta: dict[int, float] = {}                                # bucket -> a draft row's cost
        self.gain: dict[int, float] = {}                                # bucket -> the best k''s expected gain

    @staticmethod
    def bucket(batch: int) -> int:
        return max(1, batch).bit_length()

    def allow(self, batch: int, k: int = 1, proposed_per_pos: Sequence[int] = (),
              accepted_per_pos: Sequence[int] = (), offered_per_pos: Sequence[int] = ()) -> int:
        """This step's k' (0: no drafts) at ``batch`` decoding requests,
        ``k`` configured; the proposer's record so far, per draft position:
        proposals with a token there, tokens kept there, and proposals that
        could have had one (made at a k' past it)."""
        if not self.enabled:
            return k
        b = self.bucket(batch)
        plain, spec = self.plain.get(b, []), self.spec.get(b, [])
        probe = k if batch < 16 else 1
        if not plain or not spec:                   # one of each first (speculated first)
            return 0 if spec else probe
        n = self.since[b] = self.since.get(b, 0) + 1
        total = self.steps[b] = self.steps.get(b, 0) + 1
        best, gain, cost = self.expect(b, k, proposed_per_pos, accepted_per_pos, offered_per_pos)
        fewest = min(len(plain), len(spec))
        # below 16 requests a try costs little and the first speculated step pays one-time costs (a new
        # shape): min_samples of each before deciding; from 16, one of each when far from even
        unsure = fewest < self.min_samples and (batch < 16 or abs(gain - 1) < 0.25 or (fewest < 2 and gain > 0.6))
        if unsure:
            return 0 if len(spec) > len(plain) else probe
        # hysteresis: on past 1 + margin (margin 0 at batch 1, doubled from 16 requests: the estimate's
        # noise is a few percent, and a wrong 'on' costs most there), off under 0.98, so that noise near
        # even does not flip the decision each step
        margin = 0.0 if batch == 1 else self.margin * (2 if batch >= 16 else 1)
        was = self.decided.get(b)
        on = gain > (0.98 if was else 1 + margin)
        choice = best if on else 0
        if was != choice:
            self.decided[b] = choice
            lo, hi = 2 ** (b - 1), 2 ** b - 1
            # at batch 1 (on) the engine lets each draft run to k, cut by its class (Speculation.begin_step)
            batch_1 = (f"; at batch 1 each draft may run to k={k}, cut by its class's kept-rates"
                       if choice and b == 1 and choice < k else "")
            (log.info if was is None or bool(was) != bool(choice) else log.debug)("speculation cost gate: %s at %d-%d decoding requests (a speculated step costs %.2fx a "
                     "plain one per request at k=%d; expected %.2f tokens a request a step: %.2fx%s)",
                     f"k={choice}" if choice else "off", lo, hi, cost, max(best, 1), gain * cost, gain, batch_1)
        if choice:
            self.since[b] = 0
            # on: now and then a plain step keeps the plain time current (the load may change), and
            # below k a step at k measures the draft positions past k'
            if total % (2 * self.explore_every) == 0:
                return 0
            return k if choice < k and total % self.explore_every == self.explore_every // 2 else choice
        # off: try again now and then, so that the tries cost at most explore_cost of the steps
        every = max(self.explore_every, int(np.ceil(max(0.0, cost - gain * cost) / self.explore_cost)))
        if n >= every:
            self.since[b] = 0
            return max(best, 1)
        return 0

    def expect(self, b: int, k: int, proposed_per_pos: Sequence[int], accepted_per_pos: Sequence[int],
               offered_per_pos: Sequence[int]) -> tuple[int, float, float]:
        """(the best k', its expected gain, its expected cost per request
        against a plain step) in bucket ``b``."""
        plain, spec = self.plain[b], self.spec[b]
        t_plain = float(np.median(plain))
        t_spec = float(np.median([s[0] for s in spec]))
        drafts = float(np.mean([s[1] for s in spec]))      # requests with drafts / requests, in a speculated step
        rows = float(np.mean([s[2] for s in spec]))        # draft tokens / requests
        rho = t_spec / t_plain if t_plain > 0 else 1.0
        beta = max(0.0, rho - 1) / rows if rows > 0 else 0.0
        self.beta[b] = beta
        best, gain, cost = 0, 0.0, 1.0
        d = a = 0.0
        for j in range(min(k, len(proposed_per_pos), len(accepted_per_pos), len(offered_per_pos))):
            if not offered_per_pos[j]:
                break
            d += drafts * proposed_per_pos[j] / offered_per_pos[j]
            a += drafts * accepted_per_pos[j] / offered_per_pos[j]
            # each draft row costs beta of a request's plain step: measured, on a CPU, from about a
            # quarter of it at batch 1 (the rows share each weight block's decoding) to a whole one
            # at a compute-bound batch (no 'a batch-1 step reads the weights once' discount: the
            # quantized products' arithmetic grows with the rows)
            c = 1 + beta * d
            if (1 + a) / c > gain:
                best, gain, cost = j + 1, (1 + a) / c, c
        self.gain[b] = gain
        return best, gain, cost

    def row_threshold(self, batch: int) -> float | None:
        """The acceptance probability a draft row must have to pay at
        ``batch`` decoding requests: a row costs ``beta`` of a request's
        plain step and the step now yields ``gain`` a unit of time, so a row
        pays when its chance to be kept is at least ``beta * gain``. None
        before the bucket was measured."""
        b = self.bucket(batch)
        if not self.enabled or b not in self.beta:
            return None
        return self.beta[b] * max(1.0, self.gain.get(b, 1.0))

    def record(self, batch: int, k_used: int, seconds: float, num_drafts: int = 0,
               num_draft_tokens: int = 0) -> None:
        """A decode-only step at ``batch`` requests: plain (``k_used`` 0),
        or speculated with ``num_drafts`` requests verifying
        ``num_draft_tokens`` drafts."""
        if not self.enabled or seconds <= 0 or batch <= 0:
            return
        b = self.bucket(batch)
        if k_used == 0:
            got = self.plain.setdefault(b, [])
            got.append(seconds / batch)
        else:
            got = self.spec.setdefault(b, [])
            got.append((seconds / batch, num_drafts / batch, num_draft_tokens / batch))
        del got[:-self.window]


class DraftRecord:
    """Per draft class and draft position j: how many drafts reached j (the
    ones before it all kept) and how many of those had their token at j
    kept. ``cut`` keeps a draft's positions while the chance that all of
    them up to j are kept (the product of the per-position rates, each
    (kept + 1) / (reached + 2), so an unseen position is tried) stays at or
    above the gate's row threshold (``CostGate.row_threshold``: what a row
    costs against what the step yields)."""

    EXPLORE = 16

    def __init__(self, k: int):
        self.k = k
        self.cuts: dict[int, int] = {}             # class -> drafts cut short
        self.reached: dict[int, np.ndarray] = {}
        self.kept: dict[int, np.ndarray] = {}

    PRIOR = (3.0, 1.0)          # (kept, missed) counted at every position: an unseen one is tried (3/4)

    def rates(self, cls: int) -> np.ndarray:
        a, b = self.PRIOR
        reached, kept = self.reached.get(cls), self.kept.get(cls)
        if reached is None:
            return np.full(self.k, a / (a + b))
        return (kept + a) / (reached + a + b)

    def cut(self, cls: int, n: int, threshold: float | None) -> int:
        """How many of a class-``cls`` draft's ``n`` tokens to verify. Every
        ``EXPLORE``-th draft cut short in a class keeps one token more, so a
        rate that was low once is measured again (else a position cut from
        every draft would never be reached and keep its old rate)."""
        if threshold is None or n == 0:
            return n
        chance = np.cumprod(self.rates(cls)[:n])
        if chance[-1] >= threshold:
            return n
        keep = int(np.count_nonzero(chance >= threshold))
        cuts = self.cuts[cls] = self.cuts.get(cls, 0) + 1
        return keep + 1 if cuts % self.EXPLORE == 0 else keep

    def add(self, cls: int, num_proposed: int, num_accepted: int) -> None:
        if cls not in self.reached:
            self.reached[cls], self.kept[cls] = np.zeros(self.k), np.zeros(self.k)
        self.reached[cls][:min(num_accepted + 1, num_proposed)] += 1
        self.kept[cls][:num_accepted] += 1


class Speculation:
    """The engine's speculative decoding: the proposer, the drafts of the
    step being scheduled, the counters and the cost gate."""

    def __init__(self, config: FdxConfig, plugins, vocab_size: int):
        sc = config.speculative
        self.name = name = sc.method
        try:
            cls = plugins.get("proposer", name)
        except Exception as e:
            raise ConfigError(f"config key 'speculative.method': {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, Proposer)):
            raise ConfigError(f"config key 'speculative.method': {name!r} is not a Proposer subclass")
        from fdx.core.plugins import make_plugin
        self.proposer: Proposer = make_plugin(BuildContext(config, plugins, "proposer", name, vocab_size=vocab_size),
                                              "speculative.method", cls=cls)
        # a proposer that drafts for the whole step at once (overrides Proposer.propose_batch)
        self.batches = type(self.proposer).propose_batch is not Proposer.propose_batch
        self.k = sc.num_speculative_tokens
        self.vocab_size = vocab_size
        self.disable_by_batch_size = sc.disable_by_batch_size
        self.gate = CostGate(sc.cost_gate)
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k, proposed_per_pos=[0] * self.k,
                                     offered_per_pos=[0] * self.k)
        self.step_k = self.k                       # this step's k (0: the step does not speculate)
        self.step_batch = 0
        self.step_cpu0 = 0.0
        self.cpu_timed = False                     # the engine: True where its thread computes the steps (CPU, TP 1)
        self.step_decoding, self.batched = (), None    # this step's decoding requests; propose_batch's drafts
        self.step_counts = [0, 0, 0]               # this step's drafts, draft tokens, accepted tokens
        self.draft_probs: dict[str, np.ndarray] = {}
        # the draft length each request's proposals earn: per draft class (the proposer's
        # ``draft_class``, else how the request's last drafts fared) and position, how often a draft
        # reached it and how often its token there was kept (DraftRecord)
        self.record = DraftRecord(self.k)
        self.cls_of: dict[str, int] = {}           # request -> the class of this step's drafts
        self.outcome: dict[str, int] = {}          # request -> its last drafts: 0 none, 1 one rejected, 2 all kept
        self.guided = None                         # the engine's GuidedDecoding: guided requests speculate
        self.guided_truncated = 0                  # draft tokens the grammar refused (never scored)
        self.plugin_processors = bool(config.decoding.logits_processors)
        if self.plugin_processors:
            log.warning("speculative decoding is off: decoding.logits_processors names plugin processors, "
                        "which may change any row of the verified logits")
        log.info("speculative decoding: proposer %s, k=%d, cost gate %s", name, self.k,
                 "on" if sc.cost_gate else "off")

    def say_row_limit(self, rows: int | None) -> None:
        """At start, in the default mode: whether a batch-1 step's k + 1 verified rows are
        within ``rows``, the step size to which the backend's kernels give each row its
        one-row bits (``Backend.row_invariant_rows``; None: not known). Within it greedy
        outputs at batch 1 equal decoding's; past it, or at more than one sequence a
        step, a near tie can take the other token (docs/speculative.md)."""
        if rows is None:
            return
        if self.k + 1 <= rows:
            log.info("speculative decoding: k=%d: at batch 1 the %d verified rows keep decoding's bits (this "
                     "model's kernels: up to %d rows), so greedy outputs equal decoding's there; at more than one "
                     "sequence a step only backend.batch_invariant promises that", self.k, self.k + 1, rows)
        else:
            log.warning("speculative decoding: k=%d: a batch-1 step verifies %d rows, past the %d to which this "
                        "model's kernels keep each row's decoding bits: a near tie can take another token than "
                        "decoding would (k <= %d keeps them; or set backend.batch_invariant; docs/speculative.md)",
                        self.k, self.k + 1, rows, rows - 1)

    def draft_kv_bytes(self, block_size: int, max_num_seqs: int) -> tuple[int, int]:
        """(bytes a target KV block adds to the proposer's own KV, bytes it
        holds whatever the target's count): a draft model's KV cache holds
        the target's tokens plus each request's drafts; (0, 0) for a
        proposer without a KV cache."""
        return self.proposer.kv_bytes(block_size, max_num_seqs)

    def forget(self) -> None:
        """Forget what earlier requests taught: the proposer's memory of
        finished requests (its optional ``forget_history``) and the draft
        record (the benchmark's rounds: an earlier round's outputs of the
        same prompts would be drafted from, which no real workload gets);
        the gate's step times stay (they measure the machine)."""
        self.proposer.forget_history()       # suffix: its finished requests' outputs
        self.record = DraftRecord(self.k)
        self.cls_of.clear()
        self.outcome.clear()

    # -- requests ----------------------------------------------------------------------------
    def eligible(self, request) -> bool:
        """Whether a request may speculate: no logits processor of its own,
        no activation hooks or reasoning budget, not opted out, no plugin
        logits processors configured (they may touch any row), and, guided,
        tracked by the engine's guided service (its drafts are cut where the
        grammar refuses them, and every verified row is masked)."""
        from fdx.core.guided import constraint_of
        p = request.sampling_params
        guided_ok = self.guided is not None and request.request_id in self.guided.entries
        return not (self.plugin_processors or request.pooling or needs_processors(p) or opted_out(p)
                    or (constraint_of(p) is not None and not guided_ok) or p.activations is not None
                    or p.reasoning_max_tokens is not None)

    def add_request(self, request) -> None:
        if self.proposer.uses_sampling_params:     # it draws its drafts as the request samples (Proposal.draft_probs)
            self.proposer.add_request(request.request_id, list(request.prompt_token_ids),
                                      sampling_params=request.sampling_params)
        else:
            self.proposer.add_request(request.request_id, list(request.prompt_token_ids))

    def remove_request(self, request) -> None:
        self.draft_probs.pop(request.request_id, None)
        self.outcome.pop(request.request_id, None)
        self.cls_of.pop(request.request_id, None)
        self.proposer.remove_request(request.request_id, list(request.output_token_ids))

    def preempted(self, request) -> None:
        self.proposer.on_preempted(request.request_id)

    # -- a step --------------------------------------------------------------------------------
    def begin_step(self, num_decoding: int, decoding: Sequence = ()) -> None:
        """Decide this step's k from the number of requests that decode
        (``decoding``: those requests, for a proposer that drafts for all of
        them at once, ``propose_batch``)."""
        self.step_counts = [0, 0, 0]
        self.step_batch = num_decoding
        self.step_cpu0 = time.thread_time()
        self.step_decoding, self.batched = decoding, None
        if self.disable_by_batch_size is not None and num_decoding >= self.disable_by_batch_size:
            self.step_k = 0
        elif num_decoding == 0:                    # nothing decodes: nothing for the gate to decide
            self.step_k = self.k
        else:
            c = self.counters
            self.step_k = self.gate.allow(num_decoding, self.k, c.proposed_per_pos, c.accepted_per_pos,
                                          c.offered_per_pos)
            if self.step_k and num_decoding == 1 and self.gate.row_threshold(1) is not None:
                # batch 1, on: every draft at up to k, cut by its class (DraftRecord.cut). The gate's k' is
                # the best for the average draft; a strong match pays for more rows than that (the rows
                # get cheaper a row as they grow: a 9-row step 3.1x a plain one, not 1 + 8 x 0.375)
                self.step_k = self.k

    def drafts(self, request, room: int) -> list[int]:
        """Drafts for a decoding request (at most ``room`` and this step's
        k); [] when it does not speculate."""
        k = min(self.step_k, room)
        self.draft_probs.pop(request.request_id, None)
        if k <= 0 or not self.eligible(request):
            return []
        rid = request.request_id
        if self.batches and self.step_decoding:
            if self.batched is None:               # the step's first: drafts for every request that decodes
                self.batched = self._propose_batch()
            got = self.batched.get(rid)
        else:
            got = None
        if got is None:
            tokens = [*request.prompt_token_ids, *request.output_token_ids]
            got = self.proposer.propose(rid, tokens, k)
        ids, probs = check_proposal(self.name, got, self.step_k, self.vocab_size)
        ids, probs = ids[:k], (None if probs is None else probs[:k])
        if ids:                                    # cut where a row is unlikely to pay (DraftRecord.cut)
            cls = self.proposer.draft_class(rid)
            cls = self.cls_of[rid] = int(cls) if cls is not None else self.outcome.get(rid, 0)
            ids = ids[:self.record.cut(cls, len(ids), self.gate.row_threshold(self.step_batch))]
            probs = None if probs is None or not ids else probs[:len(ids)]
        if not ids:
            self.outcome[rid] = 0
        if ids and self.guided is not None and request.request_id in self.guided.entries:
            kept = self.guided.check_drafts(request.request_id, request.output_token_ids, ids,
                                            keep_refused=probs is not None)
            self.guided_truncated += len(ids) - len(kept)
            ids = kept
            probs = None if probs is None or not ids else probs[:len(ids)]
        if probs is not None:
            self.draft_probs[request.request_id] = probs
        return ids

    def _propose_batch(self) -> dict:
        """``propose_batch`` over this step's decoding requests that may
        speculate, each with this step's k (within its ``max_tokens``): one
        batched call (draft_model: a forward a draft position for all)."""
        items = []
        for r in self.step_decoding:
            k = min(self.step_k, r.max_tokens - r.num_output_tokens - 1)
            if k > 0 and self.eligible(r):
                items.append((r.request_id, [*r.prompt_token_ids, *r.output_token_ids], k))
        got = self.proposer.propose_batch(items) if items else None
        return got if got is not None else {}

    def on_accepted(self, request, num_proposed: int, num_accepted: int) -> None:
        self.draft_probs.pop(request.request_id, None)
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_proposed
        c.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            c.accepted_per_pos[j] += 1
        for j in range(num_proposed):
            c.proposed_per_pos[j] += 1
        for j in range(min(self.step_k, self.k)):       # this step's k' bounded the drafts
            c.offered_per_pos[j] += 1
        rid = request.request_id
        self.record.add(self.cls_of.pop(rid, 0), num_proposed, num_accepted)
        self.outcome[rid] = 2 if num_accepted == num_proposed else 1
        s = self.step_counts
        s[0], s[1], s[2] = s[0] + 1, s[1] + num_proposed, s[2] + num_accepted
        self.proposer.on_accepted(request.request_id, num_proposed, num_accepted)

    def end_step(self, num_tokens: int, seconds: float, decode_only: bool) -> None:
        """Time a decode-only step for the cost gate (the gate reads the
        step's drafts from ``step_counts``, not ``num_tokens``). The time is
        the engine thread's CPU time since ``begin_step`` where that thread
        computes (``cpu_timed``: the CPU backend without tensor parallel; the
        OpenMP master thread does its share of every product), else the wall
        ``seconds``. CPU time:
        on a shared machine the time other jobs take the cores is then not
        counted, and it is the same share of a plain and a speculated step."""
        cpu = time.thread_time() - self.step_cpu0 if self.cpu_timed else 0.0
        if decode_only and self.step_batch and (self.step_k == 0 or self.step_counts[0]):
            # a step allowed to speculate in which nothing was proposed tells nothing about speculation
            self.gate.record(self.step_batch, self.step_k, cpu if cpu > 0 else seconds, self.step_counts[0],
                             self.step_counts[1])

    def close(self) -> None:
        self.proposer.close()

