"""The ``device`` sampler (Paddle ops where the logits are), run for real
on the CPU: greedy equals the host sampler; sampled tokens follow the exact
filtered softmax (chi-square against a distribution computed here in
numpy); seeds repeat; logprobs equal the host sampler's; the runner hands
it the model's logits tensor unless a logits processor has work."""
from __future__ import annotations

import numpy as np
import paddle
import pytest
from scipy import stats

from fdx import SamplingParams
from fdx.core.interfaces import SamplingBatch
from fdx.plugins.decoding.device_sampler import DeviceSampler
from fdx.plugins.decoding.sampler import Sampler as HostSampler
from test_contracts import FakeDevice, make_llm, prompts, token_ids


def batch(params, outputs=None):
    n = len(params)
    return SamplingBatch(params=params, prompt_token_ids=[[1]] * n,
                         output_token_ids=outputs or [[] for _ in range(n)])


def expected(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution vLLM's semantics give, computed plainly: softmax of
    logits / T; keep the top_k; of those the smallest prefix (by probability)
    whose mass before each token is < top_p of their mass; then tokens with
    probability >= min_p * the largest; renormalize."""
    x = logits.astype(np.float64) / p.temperature
    prob = np.exp(x - x.max())
    prob /= prob.sum()
    order = np.argsort(-prob, kind="stable")
    keep = np.zeros(len(prob), dtype=bool)
    k = p.top_k if 0 < p.top_k < len(prob) else len(prob)
    top = order[:k]
    mass = prob[top].sum()
    before = np.cumsum(prob[top]) - prob[top]
    kept = top[before < p.top_p * mass]
    cutoff = max(prob[kept].min(), p.min_p * prob.max())
    keep[prob >= cutoff] = True
    out = np.where(keep, prob, 0)
    return out / out.sum()


def test_greedy_is_the_host_samplers_argmax():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 1000)).astype(np.float32)
    params = [SamplingParams(temperature=0, max_tokens=1)] * 16
    got = DeviceSampler().sample(paddle.to_tensor(logits), batch(params)).token_ids
    assert got.tolist() == HostSampler(seed=0).sample(logits, batch(params)).token_ids.tolist()
    assert got.dtype == np.int64


CASES = [dict(temperature=0.7, top_k=20), dict(temperature=1.0, top_p=0.8), dict(temperature=1.3, min_p=0.1),
         dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02), dict(temperature=1.0)]


@pytest.mark.parametrize("case", CASES)
def test_sampled_tokens_follow_the_filtered_softmax(case):
    rng = np.random.default_rng(1)
    vocab = 64
    logits = (rng.standard_normal(vocab) * 2).astype(np.float32)
    p = SamplingParams(max_tokens=1, **case)
    want = expected(logits, p)
    sampler = DeviceSampler(seed=123)
    rows = 2000
    np.testing.assert_allclose(sampler.probs(np.tile(logits, (2, 1)), batch([p, p]))[1], want, atol=1e-5)
    x = paddle.to_tensor(np.tile(logits, (rows, 1)))
    draws = np.concatenate([sampler.sample(x, batch([p] * rows)).token_ids for _ in range(10)])
    counts = np.bincount(draws, minlength=vocab)
    support = want > 0
    assert counts[~support].sum() == 0, "drew a token the filters drop"
    f_exp = want[support] * len(draws)
    assert stats.chisquare(counts[support], f_exp).pvalue > 1e-4, (counts[support], f_exp)


def test_mixed_greedy_and_sampled_rows():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_k=1 if i == 4 else 0, max_tokens=1)
              for i in range(6)]
    got = DeviceSampler(seed=0).sample(logits, batch(params)).token_ids
    argmax = logits.argmax(axis=1)
    assert got[1] == argmax[1] and got[3] == argmax[3] and got[5] == argmax[5]
    assert got[4] == argmax[4]                                  # top_k 1 is greedy too


def test_seeds_repeat_whatever_the_batch_and_match_the_host_sampler():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, 200)).astype(np.float32)
    seeded = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=1) for s in (11, 12)]
    outputs = [[5, 6, 7], [8]]
    a = DeviceSampler(seed=1).sample(logits[:2], batch(seeded, outputs)).token_ids
    other = [SamplingParams(temperature=1.0, max_tokens=1)] * 2
    b = DeviceSampler(seed=99).sample(logits[[2, 0, 1, 3]], batch([other[0], *seeded, other[1]],
                                                                   [[], *outputs, []])).token_ids
    assert a.tolist() == b[1:3].tolist()
    host = HostSampler(seed=5).sample(logits[:2], batch(seeded, outputs)).token_ids
    assert a.tolist() == host.tolist()                          # the same uniforms, the same CDF


def test_logprobs_equal_the_host_samplers():
    rng = np.random.default_rng(4)
    logits = rng.standard_normal((3, 300)).astype(np.float32)
    params = [SamplingParams(temperature=0, logprobs=3, max_tokens=1), SamplingParams(temperature=0, max_tokens=1),
              SamplingParams(temperature=0, logprobs=0, max_tokens=1)]
    dev = DeviceSampler().sample(paddle.to_tensor(logits), batch(params))
    host = HostSampler(seed=0).sample(logits, batch(params))
    assert dev.logprobs[1] is None and host.logprobs[1] is None
    for i in (0, 2):
        d, h = dev.logprobs[i], host.logprobs[i]
        assert (d.token_id, d.rank) == (h.token_id, h.rank)
        assert d.logprob == pytest.approx(h.logprob, abs=1e-5)
        assert [t for t, _ in d.top] == [t for t, _ in h.top]
        np.testing.assert_allclose([v for _, v in d.top], [v for _, v in h.top], atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints["LlamaForCausalLM"][0])


def test_the_runner_keeps_logits_on_the_device_unless_a_processor_works(tiny, monkeypatch):
    FakeDevice(monkeypatch, "cuda")
    seen = []
    real = DeviceSampler.sample
    monkeypatch.setattr(DeviceSampler, "sample", lambda self, x, b, raw_logits=None: (
        seen.append(type(x).__name__), real(self, x, b, raw_logits))[1])
    llm = make_llm(tiny, dtype="float32")
    assert type(llm.engine.sampler).__name__ == "DeviceSampler"
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = token_ids(llm.generate(prompts(), greedy))
    assert set(seen) == {"Tensor"}
    seen.clear()
    penalized = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, repetition_penalty=1.3)
    llm.generate(prompts(), penalized)
    assert set(seen) == {"ndarray"}                             # the penalty ran on the host first
    host = make_llm(tiny, backend="cpu")                        # the host sampler
    assert token_ids(host.generate(prompts(), greedy)) == plain
