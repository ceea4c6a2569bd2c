"""Sampler and logits processors against plain numpy references."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pluggy
import pytest
from scipy.stats import chisquare

from fdx.core import hookspecs
from fdx.core.sampling_params import SamplingParams as SP
from fdx.plugins.decoding import logits_processors as lp_module
from fdx.plugins.decoding.logits_processors import min_tokens, presence_frequency_penalty, repetition_penalty
from fdx.plugins.decoding.sampler import Sampler, SamplingBatch, make_generator


def make_batch(params, prompts=None, outputs=None, generators=None, eos=()):
    n = len(params)
    return SamplingBatch(params=list(params),
                         prompt_token_ids=prompts or [[] for _ in range(n)],
                         output_token_ids=outputs or [[] for _ in range(n)],
                         generators=generators, eos_token_ids=frozenset(eos))


# --- references, written plainly ----------------------------------------------

def ref_probs(logits: np.ndarray, p: SP) -> np.ndarray:
    """One row: temperature, top-k, top-p, min-p, by sorting, in float64."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    if p.top_k > 0:
        probs[order[p.top_k:]] = 0
        probs /= probs.sum()
    if p.top_p < 1:
        cum = 0.0
        keep = []
        for t in order:
            keep.append(t)
            cum += probs[t]
            assert abs(cum - p.top_p) > 1e-6, "test case sits on a top_p boundary"
            if cum >= p.top_p:
                break
        mask = np.zeros_like(probs, dtype=bool)
        mask[keep] = True
        probs[~mask] = 0
        probs /= probs.sum()
    if p.min_p > 0:
        assert np.all(np.abs(probs - p.min_p * probs.max()) > 1e-9), "min_p boundary"
        probs[probs < p.min_p * probs.max()] = 0
        probs /= probs.sum()
    return probs


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def ref_penalties(logits: np.ndarray, p: SP, prompt: list[int], output: list[int]) -> np.ndarray:
    out = logits.astype(np.float64).copy()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.presence_penalty + p.frequency_penalty * c
    return out


def assert_matches(counts: np.ndarray, probs: np.ndarray, n: int):
    assert counts[probs == 0].sum() == 0, "drew a token of probability 0"
    expected = probs[probs > 0] * n
    observed = counts[probs > 0].astype(np.float64)
    small = expected < 5                           # pool thin categories into one bin
    if small.sum() > 0:
        expected = np.append(expected[~small], expected[small].sum())
        observed = np.append(observed[~small], observed[small].sum())
    if len(expected) > 1:
        assert chisquare(observed, expected).pvalue > 1e-3


def draw(sampler, logits_row, params, rows, calls, seeded=False):
    """rows x calls samples of one row, as a batch of repeated rows."""
    logits = np.tile(logits_row, (rows, 1))
    gens = [np.random.default_rng(1000 + i) for i in range(rows)] if seeded else None
    counts = np.zeros(len(logits_row), dtype=np.int64)
    for _ in range(calls):
        out = sampler.sample(logits, make_batch([params] * rows, generators=gens))
        counts += np.bincount(out.token_ids, minlength=len(logits_row))
    return counts


# --- distributions -------------------------------------------------------------

LOGITS20 = np.random.default_rng(7).permutation(np.linspace(-2.0, 2.5, 20)).astype(np.float32)

CASES = [
    SP(),
    SP(temperature=0.6),
    SP(temperature=1.7),
    SP(top_k=5),
    SP(top_k=1),
    SP(top_p=0.55),
    SP(top_p=0.9, temperature=0.8),
    SP(min_p=0.15),
    SP(top_k=8, top_p=0.7),
    SP(top_k=10, min_p=0.2, temperature=0.9),
    SP(top_p=0.8, min_p=0.05, temperature=1.3),
    SP(top_k=12, top_p=0.85, min_p=0.1, temperature=0.7),
]


def case_id(i: int) -> str:
    p = CASES[i]
    return f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=case_id)
def test_distribution_matches_reference(case):
    # each case its own sampler seed, so the cases' draws are independent
    params = CASES[case]
    counts = draw(Sampler(seed=1000 + case), LOGITS20, params, rows=2000, calls=10)
    assert_matches(counts, ref_probs(LOGITS20, params), 20_000)


@pytest.mark.parametrize("params", [SP(top_k=40, temperature=0.8), SP(min_p=0.08), SP(top_p=0.6, top_k=200)])
def test_distribution_large_vocab_seeded_rows(params):
    # V spans several inverse-CDF blocks (and ends in a partial one); every
    # row draws from its own generator
    logits = (np.random.default_rng(3).standard_normal(600) * 2.5).astype(np.float32)
    counts = draw(Sampler(seed=5), logits, params, rows=1000, calls=20, seeded=True)
    assert_matches(counts, ref_probs(logits, params), 20_000)


def test_two_tokens_left_never_draws_the_others():
    logits = np.full(600, -1.0, dtype=np.float32)
    logits[[3, 599]] = 4.0                            # first and last (partial) block
    counts = draw(Sampler(seed=0), logits, SP(top_k=2), rows=500, calls=4)
    assert counts[3] + counts[599] == 2000 and min(counts[3], counts[599]) > 850


def test_probs_match_reference_for_many_shapes():
    # V = 10000 spans many top-k/top-p selection blocks; flat rows (scale 0.3)
    # need the whole row for top-p, peaked ones (scale 10) only a few blocks
    rng = np.random.default_rng(11)
    V = 10_000
    cases = [SP(top_k=1), SP(top_k=5, temperature=0.5), SP(top_k=200), SP(top_k=9999, top_p=0.97),
             SP(top_p=0.3), SP(top_p=0.9), SP(top_p=0.99, temperature=1.5), SP(top_k=20, top_p=0.5),
             SP(min_p=0.02), SP(top_p=0.8, min_p=0.1), SP(top_k=64, top_p=0.95, min_p=0.001, temperature=0.8), SP()]
    params = [c for c in cases for _ in range(4)]
    scales = np.array([0.3, 1.5, 4.0, 10.0] * len(cases))
    logits = (rng.standard_normal((len(params), V)) * scales[:, None]).astype(np.float32)
    got = Sampler(logits_processors=[]).probs(logits, make_batch(params))
    for i, p in enumerate(params):
        ref = ref_probs(logits[i], p)
        np.testing.assert_array_equal(got[i] > 0, ref > 0, err_msg=f"row {i}: {p}")
        np.testing.assert_allclose(got[i], ref, rtol=1e-4, atol=1e-7, err_msg=f"row {i}: {p}")


def test_top_k_keeps_ties_and_greedy_probs_are_one_hot():
    logits = np.array([[5, 4, 4, 4, 1, 0], [0, 1, 9, 2, 3, 4]], dtype=np.float32)
    got = Sampler(logits_processors=[]).probs(logits, make_batch([SP(top_k=2), SP(temperature=0)]))
    assert (got[0] > 0).tolist() == [True, True, True, True, False, False]   # vLLM: ties at the k-th kept
    assert got[1].tolist() == [0, 0, 1, 0, 0, 0]


# --- greedy and seeds ---------------------------------------------------------

def test_greedy_is_argmax_and_ignores_seeds():
    logits = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    params = [SP(temperature=0), SP(temperature=0, seed=1), SP(temperature=0, seed=2, top_k=3),
              SP(temperature=0, top_p=0.1), SP(temperature=0, min_p=0.9), SP(temperature=1e-7, seed=9)]
    gens = [make_generator(p) for p in params]
    for seed in (0, 1):
        out = Sampler(seed=seed).sample(logits, make_batch(params, generators=gens))
        np.testing.assert_array_equal(out.token_ids, logits.argmax(axis=1))
    assert out.token_ids.dtype == np.int64


def run_seeded(target: SP, logits_row, others: list[SP], position: int, steps: int, sampler_seed: int):
    """Sample `steps` tokens for `target` placed at `position` among `others`."""
    params = others[:position] + [target] + others[position:]
    gens = [make_generator(p) for p in params]
    rng = np.random.default_rng(99)
    sampler, tokens = Sampler(seed=sampler_seed), []
    for _ in range(steps):
        logits = rng.standard_normal((len(params), len(logits_row))).astype(np.float32)
        logits[position] = logits_row
        tokens.append(int(sampler.sample(logits, make_batch(params, generators=gens)).token_ids[position]))
    return tokens


def test_seed_reproduces_across_batches_and_positions():
    logits = (np.random.default_rng(1).standard_normal(500) * 0.5).astype(np.float32)
    target = SP(seed=42, top_p=0.95, temperature=1.1)
    others = [SP(), SP(seed=7), SP(temperature=0), SP(top_k=5), SP(seed=42, min_p=0.3)]
    alone = run_seeded(target, logits, [], 0, steps=20, sampler_seed=0)
    assert alone == run_seeded(target, logits, others, 3, steps=20, sampler_seed=1)
    assert alone == run_seeded(target, logits, others[:1], 0, steps=20, sampler_seed=2)
    assert alone == run_seeded(target, logits, others, 5, steps=20, sampler_seed=3)
    assert len(set(alone)) > 1                       # the generator advances between steps
    other_seed = SP(seed=43, top_p=0.95, temperature=1.1)
    assert alone != run_seeded(other_seed, logits, [], 0, steps=20, sampler_seed=0)


def test_seed_without_generator_is_still_reproducible():
    logits = np.random.default_rng(2).standard_normal((1, 300)).astype(np.float32)
    p = SP(seed=11)
    alone = Sampler(seed=0).sample(logits, make_batch([p], outputs=[[1, 2]])).token_ids[0]
    mixed = np.concatenate([np.random.default_rng(3).standard_normal((2, 300)).astype(np.float32), logits])
    out = Sampler(seed=1).sample(mixed, make_batch([SP(), SP(seed=4), p], outputs=[[], [], [1, 2]]))
    assert out.token_ids[2] == alone


def test_unseeded_rows_use_the_sampler_seed():
    logits = np.random.default_rng(4).standard_normal((3, 200)).astype(np.float32)
    batch = make_batch([SP(), SP(top_k=50), SP(top_p=0.9)])
    first = [Sampler(seed=8).sample(logits, batch).token_ids.tolist() for _ in range(2)]
    assert first[0] == first[1]                       # fresh samplers, same seed
    s = Sampler(seed=8)
    runs = [s.sample(logits, batch).token_ids.tolist() for _ in range(5)]
    assert runs[0] == first[0] and len({tuple(r) for r in runs}) > 1   # the shared generator advances


# --- logits processors --------------------------------------------------------

def test_penalties_match_naive_reference():
    rng = np.random.default_rng(5)
    V = 30
    logits = (rng.standard_normal((6, V)) * 3).astype(np.float32)
    params = [SP(repetition_penalty=1.3), SP(presence_penalty=0.7), SP(frequency_penalty=-0.4),
              SP(repetition_penalty=0.8, presence_penalty=-1.2, frequency_penalty=1.5),
              SP(), SP(presence_penalty=2.0, frequency_penalty=2.0)]
    prompts = [list(rng.integers(0, V, size=n)) for n in (8, 0, 5, 12, 7, 3)]
    outputs = [list(rng.integers(0, V, size=n)) for n in (6, 9, 10, 4, 5, 0)]
    batch = make_batch(params, prompts, outputs)
    got = presence_frequency_penalty(repetition_penalty(logits.copy(), batch), batch)
    for i, p in enumerate(params):
        np.testing.assert_allclose(got[i], ref_penalties(logits[i], p, prompts[i], outputs[i]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[4], logits[4])  # neutral rows untouched
    np.testing.assert_array_equal(got[5], logits[5])  # no output yet: nothing to penalize


def test_min_tokens_masks_eos_and_stop_ids_only_below_minimum():
    logits = np.random.default_rng(6).standard_normal((5, 12)).astype(np.float32)
    params = [SP(min_tokens=3, stop_token_ids=[5, 7]), SP(min_tokens=3, stop_token_ids=[5, 7]),
              SP(min_tokens=3, stop_token_ids=[5], ignore_eos=True), SP(stop_token_ids=[5]), SP(min_tokens=1)]
    outputs = [[1], [1, 1, 1], [], [], [4]]
    got = min_tokens(logits.copy(), make_batch(params, outputs=outputs, eos={2, 9}))
    expect = logits.copy()
    expect[0, [2, 5, 7, 9]] = -np.inf                 # under the minimum: eos and stop ids
    expect[2, 5] = -np.inf                            # ignore_eos: stop ids only
    np.testing.assert_array_equal(got, expect)        # rows 1, 3, 4 reached their minimum


def test_min_tokens_steers_greedy_away_from_eos():
    logits = np.zeros((2, 10), dtype=np.float32)
    logits[:, 2] = 5.0
    logits[:, 6] = 1.0
    batch = make_batch([SP(temperature=0, min_tokens=2)] * 2, outputs=[[0], [0, 0]], eos={2})
    assert Sampler().sample(logits, batch).token_ids.tolist() == [6, 2]


def test_processors_registered_through_the_hook():
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(lp_module)
    found = {}
    pm.hook.fdx_register_logits_processors(register=found.__setitem__)
    assert found == lp_module.BUILTIN_LOGITS_PROCESSORS
    assert set(found) == {"penalties", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words", "reasoning_budget"}


def test_no_processors_means_none_run():
    logits = np.array([[0.0, 3.0, 2.0]], dtype=np.float32)
    batch = make_batch([SP(temperature=0, repetition_penalty=2.0)], prompts=[[1]])
    assert Sampler(logits_processors=[]).sample(logits, batch).token_ids[0] == 1
    assert Sampler().sample(logits, batch).token_ids[0] == 2      # the built-ins: 3 / 2 < 2


# --- logprobs ------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_with_top_and_rank():
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal((5, 400)) * 2).astype(np.float32)
    params = [SP(logprobs=5, repetition_penalty=1.5, temperature=0.5, top_k=20), SP(logprobs=0),
              SP(), SP(logprobs=20, temperature=0, presence_penalty=2.0), SP(logprobs=3, seed=1, min_p=0.01)]
    outputs = [list(logits[0].argsort()[-3:]), [], [], list(logits[3].argsort()[-2:]), []]
    batch = make_batch(params, outputs=outputs, generators=[make_generator(p) for p in params])
    before = logits.copy()
    out = Sampler(seed=0).sample(logits, batch)
    np.testing.assert_array_equal(logits, before)     # the caller's logits are untouched
    assert out.logprobs[2] is None
    for i in (0, 1, 3, 4):
        ref = ref_log_softmax(logits[i])
        lp, tok = out.logprobs[i], int(out.token_ids[i])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(ref[tok], abs=1e-5)
        assert lp.rank == 1 + int((ref > ref[tok]).sum())
        n = params[i].logprobs
        assert [t for t, _ in lp.top] == list(np.argsort(-ref)[:n])
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:n], atol=1e-5)
    assert out.logprobs[1].top == []
    assert out.logprobs[3].rank > 1                    # penalties moved greedy off the raw argmax


# --- a mixed batch ------------------------------------------------------------

def test_mixed_batch_rows_get_what_they_would_alone():
    rng = np.random.default_rng(9)
    V = 300
    rows = [  # (params, prompt, output)
        (SP(temperature=0), [1, 2], []),
        (SP(seed=3, top_k=30), [4], [5, 6]),
        (SP(top_p=0.9), [], []),                      # the batch's only unseeded row
        (SP(seed=4, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3, min_p=0.05),
         list(rng.integers(0, V, 20)), list(rng.integers(0, V, 8))),
        (SP(temperature=0, frequency_penalty=1.0, logprobs=4), [7], [8, 8, 9]),
        (SP(seed=5, logprobs=2, temperature=0.7, min_tokens=5, stop_token_ids=[11]), [3], [12]),
    ]
    logits = (rng.standard_normal((len(rows), V)) * 2).astype(np.float32)
    logits[5, [0, 11]] = 9.0                          # eos 0 and stop id 11 are likely but masked

    def run(idx):
        ps = [rows[i][0] for i in idx]
        batch = make_batch(ps, [rows[i][1] for i in idx], [rows[i][2] for i in idx],
                           [make_generator(p) for p in ps], eos={0})
        return Sampler(seed=77).sample(logits[idx], batch)

    together = run(list(range(len(rows))))
    for i in range(len(rows)):
        alone = run([i])
        assert together.token_ids[i] == alone.token_ids[0], f"row {i}"
        a, b = together.logprobs[i], alone.logprobs[0]
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
    assert together.token_ids[5] not in (0, 11)


# --- validation -----------------------------------------------------

def test_shape_mismatches_are_errors():
    with pytest.raises(ValueError):
        SamplingBatch(params=[SP()], prompt_token_ids=[], output_token_ids=[[]])
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 5), dtype=np.float32), make_batch([SP()]))
