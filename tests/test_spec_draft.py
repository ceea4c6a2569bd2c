"""The draft_model proposer (docs/speculative.md): a second model with its
own KV cache drafts greedily. Self-drafting with the target keeps every
draft; a different draft model changes no token of a greedy output
(against the same engine without speculation, with chunked prefill and
preemption, batched); sampled outputs keep their distribution (chi-square
against speculation off); a draft that cannot serve is a config error
naming ``speculative.model``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from tiny_models import TinyLlama

VOCAB = 256
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=8, progress=False)


class Perturbed(TinyLlama):
    """The target's weights plus noise: a different model that often agrees with it, and not always."""
    def weights(self):
        rng = np.random.default_rng(99)
        return {k: (v + 0.15 * rng.standard_normal(v.shape) * v.std()).astype(np.float32) if v.std() else v
                for k, v in super().weights().items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = TinyLlama(vocab=VOCAB, hidden=64, intermediate=128, heads=4, kv_heads=2, max_len=128, seed=1)
    draft = Perturbed(vocab=VOCAB, hidden=64, intermediate=128, heads=4, kv_heads=2, max_len=128, seed=1)
    other = TinyLlama(vocab=VOCAB + 8, hidden=32, intermediate=64, heads=2, kv_heads=1, layers=1, max_len=128)
    return {"target": str(target.hf_dir(root / "target")), "draft": str(draft.hf_dir(root / "draft")),
            "other": str(other.hf_dir(root / "other")), "gguf": str(draft.gguf_file(root / "draft.gguf"))}


def _prompts(seed=3, lens=(5, 12, 30, 8)):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, VOCAB, n).tolist()} for n in lens]


def _run(path, prompts, sp, spec=None, **engine):
    llm = LLM(path, **{**ENGINE, **engine},
              **({"speculative_config": {"num_speculative_tokens": 4, "cost_gate": False, **spec}} if spec else {}))
    outs = llm.generate(prompts, sp)
    got = [[c.token_ids for c in o.outputs] for o in outs]
    counters = llm.engine.speculation.counters if spec else None
    if spec:                                     # every request done: the draft's KV blocks are all free again
        draft = llm.engine.speculation.proposer
        assert sorted(draft.free) == list(range(draft.spec.num_blocks)) and not draft.seqs
    recomputed = llm.engine.num_recomputed_tokens
    llm.close()
    return got, counters, recomputed


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_self_draft_keeps_every_draft(models):
    prompts = _prompts()
    ref, _, _ = _run(models["target"], prompts, GREEDY)
    got, c, _ = _run(models["target"], prompts, GREEDY, spec={"method": "draft_model", "model": "self"})
    assert got == ref
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens == c.num_draft_tokens
    assert c.mean_accepted_length > 4


SEEDED = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, ignore_eos=True, seed=5)
# chunked prefill and preemption (12 blocks: 1.5 sequences); a GGUF draft; seeded sampling, preempted
CASES = [("draft", dict(max_num_batched_tokens=16, num_kv_blocks=12, max_model_len=64), GREEDY),
         ("gguf", dict(max_num_seqs=3), GREEDY),
         ("draft", dict(num_kv_blocks=12, max_model_len=64), SEEDED)]


@pytest.mark.parametrize("draft,engine,sp", CASES, ids=["chunked-preempted", "gguf-draft", "seeded-preempted"])
def test_draft_model_outputs_equal_no_speculation(models, draft, engine, sp):
    prompts = _prompts(lens=(5, 12, 30, 8, 3, 20))
    ref, _, _ = _run(models["target"], prompts, sp, **engine)
    got, c, recomputed = _run(models["target"], prompts, sp,
                              spec={"method": "draft_model", "model": models[draft]}, **engine)
    assert got == ref
    assert 0 < c.num_accepted_tokens < c.num_draft_tokens      # drafts kept and rejected
    if sp is GREEDY:
        assert c.accepted_per_pos[2] > 0                        # deep drafts kept too
    if engine.get("num_kv_blocks") == 12:
        assert recomputed > 0                                   # requests were preempted and resumed


def test_config_takes_vllms_draft_model_json():
    from fdx.core.config import FdxConfig
    for spec in ({"method": "draft_model", "model": "d.gguf"}, {"model": "d.gguf"}):   # a model alone: vLLM's too
        sc = FdxConfig.build(speculative_config=json.dumps({**spec, "num_speculative_tokens": 3})).speculative
        assert (sc.method, sc.model, sc.num_speculative_tokens) == ("draft_model", "d.gguf", 3)


def test_bad_draft_is_a_config_error(models, tmp_path):
    with pytest.raises(ConfigError, match="speculative.model.*vocabulary has 264 tokens, the target's 256"):
        LLM(models["target"], speculative_config={"method": "draft_model", "model": models["other"]}, **ENGINE)
    import shutil
    swapped = shutil.copytree(models["draft"], tmp_path / "swapped")     # the same size, two ids swapped
    tok = json.loads((swapped / "tokenizer.json").read_text())
    tok["model"]["vocab"].update({"w5": 6, "w6": 5})
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="speculative.model.*tokenizer differs.*token 'w5': id 6 in the draft"):
        LLM(models["target"], speculative_config={"method": "draft_model", "model": str(swapped)}, **ENGINE)
    with pytest.raises(ConfigError, match="speculative.model.*does not exist"):
        LLM(models["target"], speculative_config={"method": "draft_model", "model": str(tmp_path / "nope")},
            **ENGINE)
    with pytest.raises(ConfigError, match="speculative.model.*needs the draft model's path"):
        LLM(models["target"], speculative_config={"method": "draft_model"}, **ENGINE)


def test_draft_model_drafts_for_every_request_in_one_forward_a_position(models):
    """A step's drafts for all its decoding requests take k forwards of the
    draft (catch-up rows included), not k a request."""
    k = 3
    llm = LLM(models["target"], speculative_config={"model": models["draft"], "num_speculative_tokens": k,
                                                    "cost_gate": False}, **ENGINE)
    eng = llm.engine
    for p in _prompts():
        eng.add_request(eng.make_request(p["prompt_token_ids"], GREEDY))
    most = 0
    try:
        while eng.has_unfinished():
            before = eng.speculation.proposer.forwards
            eng.step()
            assert eng.speculation.proposer.forwards - before <= k
            most = max(most, eng.last_stats.spec_num_drafts)
    finally:
        llm.close()
    assert most == len(_prompts())              # a step where every request verified drafts


def test_draft_kv_shares_the_kv_budget_and_tensor_parallel_is_refused(models):
    """With the KV cache sized from a byte budget, the target's blocks and the
    draft's (as many tokens, plus the drafts' room) fit in it together;
    under tensor parallel the draft model is a config error, not a draft
    running beside the ranks untested."""
    budget = 64 * 4096
    engine = {**ENGINE, "num_kv_blocks": None, "kv_cache_memory_bytes": budget, "max_num_seqs": 4}
    alone = LLM(models["target"], **engine)
    with_draft = LLM(models["target"], speculative_config={"model": models["draft"], "num_speculative_tokens": 4},
                     **engine)
    bpb = alone.engine.kv_spec.bytes_per_block
    blocks, draft = with_draft.engine.kv_spec.num_blocks, with_draft.engine.speculation.proposer
    try:
        assert alone.engine.kv_spec.num_blocks == budget // bpb
        with_draft.generate(_prompts()[:1], SamplingParams(max_tokens=6))       # the draft proposes: its cache is made
        assert blocks * bpb + draft.spec.num_blocks * draft.spec.bytes_per_block <= budget
        assert draft.spec.num_blocks >= blocks and blocks < budget // bpb
    finally:
        alone.close()
        with_draft.close()
    from fdx.core.config import FdxConfig
    from fdx.core.interfaces import BuildContext
    from fdx.plugins.spec.draft_model import DraftModelProposer
    cfg = FdxConfig.build(model=models["target"], tensor_parallel_size=2,
                          speculative_config={"model": models["draft"]})
    with pytest.raises(ConfigError, match="speculative.model.*does not run under tensor parallel"):
        DraftModelProposer(None, BuildContext(cfg, vocab_size=VOCAB))


def test_sampled_distribution_matches_speculation_off(models):
    """Unseeded sampling: the tokens at the first three output positions of
    many runs with the draft model and without are one distribution
    (chi-square, the pattern of test_spec.py); a verifier that kept every
    draft would put the mass on the draft's argmax."""
    from scipy.stats import chi2_contingency
    prompt = {"prompt_token_ids": [7, 8, 9, 10] * 4}
    sp = SamplingParams(temperature=1.5, top_k=4, max_tokens=3, ignore_eos=True)
    N = 200
    off, _, _ = _run(models["target"], [prompt] * N, sp, max_num_seqs=N)
    on, c, _ = _run(models["target"], [prompt] * N, sp, spec={"method": "draft_model", "model": models["draft"]},
                    max_num_seqs=N)
    for pos in range(3):
        a = [o[0][pos] for o in off]
        b = [o[0][pos] for o in on]
        keys = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in keys], [b.count(t) for t in keys]])
        assert chi2_contingency(table).pvalue > 1e-3, (pos, table)
    assert c.num_drafts > 0 and 0 < c.num_accepted_tokens < c.num_draft_tokens


def test_conformance_kit_drives_the_draft_model(tmp_path):
    """The kit's random requests, preempted at random: every proposal within
    the contract, every output the kit's model's own."""
    from fdx.core.config import FdxConfig
    from fdx.core.testing import VOCAB as KIT_VOCAB, check_proposer
    path = TinyLlama(vocab=KIT_VOCAB, hidden=32, intermediate=64, heads=2, kv_heads=1, max_len=512).hf_dir(
        tmp_path / "kit")
    cfg = FdxConfig.build(speculative={"method": "draft_model", "model": str(path), "num_speculative_tokens": 4,
                                       "cost_gate": False}, cache={"block_size": 8})
    figures = check_proposer("draft_model", config=cfg, num_requests=4, max_tokens=20)
    assert figures["mean_accepted_length"] >= 1         # it proposed
