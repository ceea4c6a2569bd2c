"""Greedy outputs are unchanged pairwise over scheduler x cache x tensor
parallel x guided decoding x KV connector (issue 19).

The factors are the real values the code registers: the KV scheduler
(``v1``, ``v0``), the waiting-queue policy (``fcfs``, ``priority``,
``lpm``), the victim policy, the KV cache (``paged``, ``prefix``), a roomy
or a tight pool (the tight one makes v1 preempt), chunked prefill on a
small budget or off, ``parallel.tensor_parallel_size`` 1 or 2, guided
decoding (off, a choice, a JSON schema, a regex: llguidance), and the KV
connector (none, the built-in ``swap`` tier in host memory, and
tests/plugin_pkg's outside ``example-memory`` store, which loads back what
it saved, and ``example-layer-recorder``, which sees every layer's calls).

Rows come from an all-pairs covering array built here (``all_pairs``: a
small greedy generator, then every row whose pairs the others cover is
dropped), checked to cover every allowed pair of values and to lose one
when any row is dropped. A pair fdx refuses by design (a connector under
tensor parallel) is in no row: a row of its own asserts the config error
that names the key.

Each row runs one engine over two batches of prompts of different lengths
(the second shares prefixes with the first, so the prefix cache, the swap
tier and the outside store have something to hit) with per-request
priorities, greedy; the reference is the same batches on the default
configuration at TP 1 with the same guided constraints, and, for the
unconstrained requests, transformers on the same checkpoint
(tests/test_llm.py's hf_greedy). Token ids must be equal. Rows also check
that their factor did something (hits, loads, preemptions, chunks), so a
row cannot pass by not exercising what it names.

Cost: the rows run on the tiny random Llama of tests/conftest.py (slow:
the TP rows start worker processes); two cheap rows and a refusal run in
the quick subset on a checkpoint written with numpy (no torch), on the
Paddle kernels (no kernel build).
"""
from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from tiny_models import TinyLlama

# -- the factors ---------------------------------------------------------------------------

# In this order because the generator seeds each row from the first uncovered pair in factor order:
# tensor parallel first (its rows start worker processes) packs its pairs into the fewest rows
# (4 of 17 at TP 2: the least possible beside 4 guided values; 6 of 19 in the order above).
FACTORS: dict[str, tuple] = {
    "tp": (1, 2),
    "guided": ("off", "choice", "json", "regex"),
    "connector": ("none", "swap", "example-memory", "example-layer-recorder"),
    "resource_manager": ("v1", "v0"),
    "policy": ("fcfs", "priority", "lpm"),
    "preemption": ("newest", "least-computed"),
    "kv_cache": ("paged", "prefix"),
    "pool": ("roomy", "tight"),
    "chunking": ("chunk16", "unchunked"),
}

# Pairs fdx refuses by design, and the config key its error names.
REFUSED: dict[frozenset, str] = {
    frozenset({("tp", 2), ("connector", c)}): "cache.kv_connector"
    for c in FACTORS["connector"] if c != "none"}


def refused_pair(row: dict) -> frozenset | None:
    """The first refused pair the (partial) row holds, if any."""
    items = set(row.items())
    return next((p for p in REFUSED if p <= items), None)


def pairs_of(row: dict, names: list[str]) -> set[tuple]:
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2) if a in row and b in row}


def required_pairs(factors: dict[str, tuple], refused: Callable[[dict], object]) -> set[tuple]:
    names = list(factors)
    return {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
            for x in factors[a] for y in factors[b] if not refused({a: x, b: y})}


def all_pairs(factors: dict[str, tuple], refused: Callable[[dict], object] = lambda row: None) -> list[dict]:
    """A covering array of strength 2: rows (one value per factor) such that
    every pair of values of two factors that ``refused`` allows is in some
    row, and no row holds a refused pair. Greedy: each row starts from the
    first pair still uncovered, then takes, factor by factor, the allowed
    value that covers the most uncovered pairs with what the row holds
    (ties: the first value). Then rows whose pairs the others all cover
    are dropped (the last first), so each row covers a pair of its own."""
    names = list(factors)
    todo = required_pairs(factors, refused)
    rows: list[dict] = []
    while todo:
        (a, x), (b, y) = min(todo, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]),
                                                 factors[p[0][0]].index(p[0][1]), factors[p[1][0]].index(p[1][1])))
        row = {a: x, b: y}
        for name in names:
            if name in row:
                continue
            best, gain = None, -1
            for value in factors[name]:
                trial = {**row, name: value}
                if refused(trial):
                    continue
                g = len(pairs_of(trial, names) & todo)
                if g > gain:
                    best, gain = value, g
            if best is None:
                raise ValueError(f"no value of {name} fits beside {row}")
            row[name] = best
        row = {n: row[n] for n in names}
        rows.append(row)
        todo -= pairs_of(row, names)
    for i in range(len(rows) - 1, -1, -1):
        others = set().union(*(pairs_of(r, names) for j, r in enumerate(rows) if j != i))
        if pairs_of(rows[i], names) <= others:
            del rows[i]
    return rows


def uncovered(rows: list[dict], factors: dict[str, tuple], refused: Callable[[dict], object]) -> set[tuple]:
    names = list(factors)
    have = set().union(*(pairs_of(r, names) for r in rows)) if rows else set()
    return required_pairs(factors, refused) - have


ROWS = all_pairs(FACTORS, refused_pair)


def row_id(row: dict) -> str:
    return "-".join(f"tp{v}" if k == "tp" else str(v) for k, v in row.items())


# -- the covering array itself ------------------------------------------------------------------

def test_the_array_covers_every_allowed_pair_and_holds_no_refused_one():
    assert uncovered(ROWS, FACTORS, refused_pair) == set()
    assert not any(refused_pair(r) for r in ROWS)
    assert all(set(r) == set(FACTORS) and all(r[k] in FACTORS[k] for k in r) for r in ROWS)
    # far fewer rows than the full product (4 x 4 x 2 ... = 3072), and at least the largest pair product
    assert 16 <= len(ROWS) <= 20, len(ROWS)
    assert sum(r["tp"] == 2 for r in ROWS) == 4


def test_dropping_any_row_loses_a_pair():
    """The check can fail: each row covers a pair no other row does."""
    for i in range(len(ROWS)):
        lost = uncovered(ROWS[:i] + ROWS[i + 1:], FACTORS, refused_pair)
        assert lost, f"row {i} ({row_id(ROWS[i])}) covers nothing of its own"


def test_the_generator_covers_a_brute_force_on_small_factor_sets():
    """On small factor sets (with and without a refused pair) the array
    covers exactly the allowed pairs, each row a pair of its own; and
    against a brute force over all rows of the product, every allowed pair
    is in some row of it (the refused pair in none)."""
    small = {"a": (0, 1, 2), "b": ("x", "y"), "c": (True, False), "d": (5, 6, 7)}
    bad = frozenset({("a", 2), ("d", 7)})

    def refused(row):
        return bad <= set(row.items())
    for ref in (lambda row: None, refused):
        rows = all_pairs(small, ref)
        assert uncovered(rows, small, ref) == set()
        assert not any(ref(r) for r in rows)
        assert all(uncovered(rows[:i] + rows[i + 1:], small, ref) for i in range(len(rows)))
        assert len(rows) < 3 * 2 * 2 * 3
        product = [dict(zip(small, v)) for v in itertools.product(*small.values()) if not ref(dict(zip(small, v)))]
        assert uncovered(product, small, ref) == set()
    assert (("a", 2), ("d", 7)) not in required_pairs(small, refused)


# -- what a row runs ------------------------------------------------------------------------------

BLOCK = 8
MAX_LEN = 64
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4}
GUIDED = {
    "off": {},
    "choice": {"guided_choice": ["Paris", "London", "Rome"]},
    "json": {"guided_json": SCHEMA},
    "regex": {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
}
PLAIN = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def prompt_batches(vocab: int, seed: int = 19) -> list[list[list[int]]]:
    """Two batches of four prompts, 2 to 37 tokens. The second repeats two
    prompts of the first, extends one, and shares two full blocks with the
    21-token one. The last two of each batch run plain (24 tokens each, in
    every row): in the tight pool (8 blocks, one longest sequence) they
    cannot both finish without v1 preempting one."""
    rng = np.random.default_rng(seed)
    a, b, c, e = (rng.integers(3, vocab, n).tolist() for n in (21, 5, 2, 13))
    d = a[:2 * BLOCK] + rng.integers(3, vocab, 21).tolist()
    return [[b, c, a, e], [b, c + rng.integers(3, vocab, 11).tolist(), d, e]]


def batch_params(guided: str) -> list[SamplingParams]:
    """Each batch: the constraint on the first two requests; the last two run plain beside them."""
    if guided == "off":
        return [PLAIN] * 4
    constrained = SamplingParams(temperature=0.0, max_tokens=20, **GUIDED[guided])
    return [constrained, constrained, PLAIN, PLAIN]


def row_config(row: dict) -> dict:
    """LLM keyword arguments for a row (the config keys it sets)."""
    kw: dict = dict(max_model_len=MAX_LEN, block_size=BLOCK, progress=False,
                    resource_manager=row["resource_manager"], policy=row["policy"], preemption=row["preemption"],
                    kv_cache=row["kv_cache"], num_kv_blocks=48 if row["pool"] == "roomy" else MAX_LEN // BLOCK,
                    tensor_parallel_size=row["tp"])
    if row["chunking"] == "chunk16":
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=16)
    else:
        kw.update(enable_chunked_prefill=False)
    if row["guided"] != "off":
        kw["guided_backend"] = "llguidance"
    if row["connector"] != "none":
        kw["kv_connector"] = row["connector"]
    if row["connector"] == "swap":
        kw["plugins.connector.swap"] = {"max_blocks": 64}
    return kw


REFERENCE = dict(max_model_len=MAX_LEN, block_size=BLOCK, num_kv_blocks=48, guided_backend="llguidance",
                 progress=False)


class Run:
    """What one engine said over the batches, and what it did on the way."""

    def __init__(self, tokens, preemptions, chunked, stats):
        self.tokens, self.preemptions, self.chunked, self.stats = tokens, preemptions, chunked, stats


def run_batches(llm: LLM, batches, params: list[SamplingParams]) -> Run:
    """Each batch through the engine's own API (priorities: the last request
    first), to the end; the token ids of every request, in order."""
    eng = llm.engine
    tokens, preemptions, chunked = [], 0, False
    for batch in batches:
        reqs = []
        for i, (ids, sp) in enumerate(zip(batch, params)):
            eng.guided.validate(sp)                # compiles now, as LLM.generate does
            req = eng.make_request(list(ids), sp, priority=len(batch) - i)
            eng.add_request(req)
            reqs.append(req)
        while eng.has_unfinished():
            eng.step()
            scheduled = eng.last_schedule.num_scheduled_tokens if eng.last_schedule is not None else {}
            # a prompt chunk: scheduled this step, and its prompt still not all computed
            chunked |= any(r.request_id in scheduled and r.num_computed_tokens < r.num_prompt_tokens for r in reqs)
        preemptions += sum(r.num_preemptions for r in reqs)
        assert all(r.is_finished for r in reqs)
        tokens.append([list(r.output_token_ids) for r in reqs])
    stats = dict(eng.kv_cache.stats() or {})
    if eng.connector is not None:
        stats.update(eng.connector.stats() or {})
    return Run(tokens, preemptions, chunked, stats)


def check_exercised(row: dict, run: Run) -> None:
    """The row's factors did something: a prefix hit, a tier or store load,
    a preemption under v1's tight pool, a chunked prompt."""
    if row["kv_cache"] == "prefix":          # the tight pool (one longest sequence) may evict all it cached
        key = "prefix_cache_hits" if row["pool"] == "roomy" else "prefix_cache_evictions"
        assert run.stats.get("prefix_cache_hits", 0) > 0 or run.stats.get(key, 0) > 0, run.stats
    if row["connector"] == "swap" and row["kv_cache"] == "paged":
        assert run.stats.get("swap_loaded_blocks", 0) > 0, run.stats
    if row["connector"] == "example-memory" and row["kv_cache"] == "paged":
        assert run.stats.get("loaded_blocks", 0) > 0, run.stats
    if row["pool"] == "tight" and row["resource_manager"] == "v1":
        assert run.preemptions > 0
    if row["resource_manager"] == "v0":
        assert run.preemptions == 0                # v0 never preempts
    if row["chunking"] == "chunk16":
        assert run.chunked


def check_guided_outputs(llm: LLM, guided: str, run: Run) -> None:
    """The constrained outputs that ended by their constraint (eos) obey it; at least one did."""
    import re
    if guided == "off":
        return
    eos, ended = set(llm.tokenizer.eos_token_ids), 0
    for batch in run.tokens:
        for ids in batch[:2]:
            if not ids or ids[-1] not in eos:
                continue                           # hit max_tokens: a prefix of a match
            ended += 1
            text = llm.tokenizer.decode(ids[:-1])
            if guided == "choice":
                assert text in GUIDED["choice"]["guided_choice"], text
            elif guided == "regex":
                assert re.fullmatch(GUIDED["regex"]["guided_regex"], text), text
            else:
                import jsonschema
                jsonschema.validate(json.loads(text), SCHEMA)
    assert ended > 0, run.tokens


# -- the rows, on the tiny random Llama --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    return str(path), hf


@pytest.fixture(scope="module")
def batches():
    return prompt_batches(49152)


@pytest.fixture(scope="module")
def references(tiny, batches):
    """guided value -> the reference Run: the default configuration at TP 1."""
    with LLM(tiny[0], **REFERENCE) as llm:
        return {g: run_batches(llm, batches, batch_params(g)) for g in GUIDED}


def test_the_reference_equals_transformers(references, tiny, batches):
    """The reference's plain requests (all of them when guided is off, the
    last two of each batch otherwise) are transformers' greedy tokens (a
    near-tie may follow fdx's pick: tests/test_llm.py's hf_greedy)."""
    from test_llm import hf_greedy
    hf = {}
    for g, run in references.items():
        for b, batch in enumerate(batches):
            for i in range(0 if g == "off" else 2, len(batch)):
                got, key = run.tokens[b][i], tuple(batch[i])
                if key not in hf:
                    hf[key] = hf_greedy(tiny[1], batch[i], PLAIN.max_tokens)
                if got != hf[key]:
                    assert got == hf_greedy(tiny[1], batch[i], PLAIN.max_tokens, follow=got), (g, b, i)
    assert references["choice"].tokens != references["off"].tokens     # the constraint steered it


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=row_id)
def test_row_equals_the_reference(row, tiny, batches, references, request):
    if row["connector"].startswith("example-"):
        request.getfixturevalue("example_plugin_installed")
    with LLM(tiny[0], **row_config(row)) as llm:
        if row["tp"] == 2:
            assert len(llm.engine.executor.procs) == 2
        run = run_batches(llm, batches, batch_params(row["guided"]))
        check_guided_outputs(llm, row["guided"], run)
    assert run.tokens == references[row["guided"]].tokens, row     # and so transformers' (the test above)
    check_exercised(row, run)


REFUSAL_ROWS = [dict(ROWS[0], tp=2, connector=c) for c in FACTORS["connector"] if c != "none"]


@pytest.mark.slow
@pytest.mark.parametrize("row", REFUSAL_ROWS, ids=row_id)
def test_refused_pair_is_a_config_error_naming_the_key(row, tiny, request):
    if row["connector"].startswith("example-"):
        request.getfixturevalue("example_plugin_installed")
    key = REFUSED[refused_pair(row)]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        LLM(tiny[0], **row_config(row))


# -- the cheap rows, in the quick subset: a numpy-written checkpoint, the Paddle kernels ------------

QUICK_VOCAB = 64
CHEAP = [r for r in ROWS if r["tp"] == 1 and r["guided"] == "off" and r["connector"] in ("none", "swap")]


def numpy_llama(path):
    """A random two-layer Llama (hidden 32, 4 heads / 2 KV heads) written
    with numpy and safetensors, and a word-level tokenizer: no torch."""
    return str(TinyLlama(vocab=QUICK_VOCAB, hidden=32, intermediate=64, heads=4, kv_heads=2, max_len=MAX_LEN,
                         seed=5, scale=0.4).hf_dir(path))


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """(checkpoint, the reference Run of its default configuration), with the
    compiled kernels off (no build in the quick subset)."""
    path = numpy_llama(tmp_path_factory.mktemp("pairwise") / "llama")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FDX_DISABLE_CPP_OPS", "1")
        with LLM(path, **{k: v for k, v in REFERENCE.items() if k != "guided_backend"}) as llm:
            ref = run_batches(llm, prompt_batches(QUICK_VOCAB), batch_params("off"))
    return path, ref


@pytest.mark.parametrize("row", CHEAP, ids=row_id)
def test_cheap_row_equals_the_reference(row, quick, monkeypatch):
    path, ref = quick
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")
    with LLM(path, **row_config(row)) as llm:
        run = run_batches(llm, prompt_batches(QUICK_VOCAB), batch_params("off"))
    assert run.tokens == ref.tokens
    check_exercised(row, run)


def test_cheap_refusal_before_any_worker_starts(quick):
    row = dict(CHEAP[0], tp=2, connector="swap")
    with pytest.raises(ConfigError, match=r"cache\.kv_connector"):
        LLM(quick[0], **row_config(row))


# -- one prefill/decode pair (the splitwise connector: two engines) ----------------------------------

@pytest.mark.slow
def test_a_prefill_decode_pair_equals_the_reference(tiny, batches, references):
    """The splitwise connector moves each prompt's KV from a prefill engine
    (the default parts) to a decode engine running v0, priority and the
    prefix cache in a tight pool with chunked prefill; the decode side's
    tokens are the reference's. (It cannot pair with tensor parallel, and
    its guided rows would need the constraint on both sides: not here.)"""
    from serve_utils import free_port
    from splitwise_utils import run
    from fdx.core.config import FdxConfig
    from fdx.core.engine import EngineCore
    port = free_port()
    common = dict(model=tiny[0], max_model_len=MAX_LEN, block_size=BLOCK)
    sw = {"connector_secret": "pairwise", "transfer_timeout_s": 10.0}
    pre = EngineCore(FdxConfig.build(**common, num_kv_blocks=48, splitwise={**sw, "role": "prefill"}), progress=False)
    dec = EngineCore(FdxConfig.build(**common, **{k: v for k, v in row_config(
        {"tp": 1, "guided": "off", "connector": "none", "resource_manager": "v0", "policy": "priority",
         "preemption": "newest", "kv_cache": "prefix", "pool": "tight", "chunking": "chunk16"}).items()
        if k not in ("progress", "max_model_len", "block_size")},
        splitwise={**sw, "role": "decode", "connector_port": port}), progress=False)
    peer = f"tcp://127.0.0.1:{port}"
    try:
        got = []
        for b, batch in enumerate(batches):
            for i, p in enumerate(batch):
                rid = f"pd{b}-{i}"
                dec.add_request(dec.make_request(p, SamplingParams(
                    temperature=0.0, max_tokens=PLAIN.max_tokens, ignore_eos=True,
                    extra_args={"splitwise": {"remote_prefill": True}}), request_id=rid, priority=len(batch) - i))
                pre.add_request(pre.make_request(p, SamplingParams(
                    temperature=0.0, max_tokens=1, extra_args={"splitwise": {"remote_decode": peer}}), request_id=rid))
            done = run(pre, dec, timeout=120)
            got.append([done[(id(dec), f"pd{b}-{i}")].output_token_ids for i in range(len(batch))])
        assert got == references["off"].tokens
        ps, ds = pre.connector.stats(), dec.connector.stats()
        assert ds["splitwise_transfers_received"] == ps["splitwise_transfers_sent"] > 0    # KV did move
        assert ds["splitwise_first_token_differ"] == 0
    finally:
        pre.shutdown()
        dec.shutdown()
