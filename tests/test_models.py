"""The model architectures against Hugging Face transformers (torch, float32).

Each case builds a tiny random transformers model, hands its state dict to
the fdx model, and compares logits and greedy tokens while fdx runs over
the paged KV cache (block_size 4, shuffled block ids).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import pytest
import torch
import transformers

from fdx.ops import cpp
from fdx.core.interfaces import AttentionContext, BuildContext
from fdx.ops.attention import build_attention_metadata
from fdx.plugins.backends.attention import CpuAttention, PaddleAttention

# write_kv/forward of fdx.ops dispatch on the metadata's impl ("paddle" or "cpp");
# impl "cpp" runs the cpu backend, whose fused rope_write_kv kernel the model calls too.
REFERENCE_ATTENTION = PaddleAttention()
from fdx.plugins.models import ernie4_5, llama, qwen2, qwen3
from fdx.plugins.models.layers import allocate_kv_caches

MODULES = {"LlamaForCausalLM": llama, "Qwen2ForCausalLM": qwen2,
           "Qwen3ForCausalLM": qwen3, "Ernie4_5ForCausalLM": ernie4_5}
CONFIGS = {"LlamaForCausalLM": transformers.LlamaConfig, "Qwen2ForCausalLM": transformers.Qwen2Config,
           "Qwen3ForCausalLM": transformers.Qwen3Config, "Ernie4_5ForCausalLM": transformers.Ernie4_5Config}
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=None, pad_token_id=0)
LLAMA3 = dict(rope_type="llama3", rope_theta=10000.0, factor=4.0, low_freq_factor=1.0,
              high_freq_factor=4.0, original_max_position_embeddings=32)

CASES = {  # id -> (architecture, config overrides)
    "llama-tied": ("LlamaForCausalLM", dict(tie_word_embeddings=True, rope_theta=1e5)),
    "llama-untied-bias-llama3": ("LlamaForCausalLM", dict(
        tie_word_embeddings=False, attention_bias=True, mlp_bias=True, num_hidden_layers=3,
        rope_parameters=LLAMA3)),
    "qwen2-bias-untied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2-bias-tied": ("Qwen2ForCausalLM", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "qwen3-tied-hd32": ("Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=32)),
    "qwen3-untied-bias-hd32": ("Qwen3ForCausalLM", dict(
        tie_word_embeddings=False, head_dim=32, attention_bias=True, num_hidden_layers=3)),
    "ernie-tied-mha": ("Ernie4_5ForCausalLM", dict(
        tie_word_embeddings=True, head_dim=16, num_key_value_heads=4, rope_theta=1e4)),
    "ernie-untied-bias-hd32": ("Ernie4_5ForCausalLM", dict(
        tie_word_embeddings=False, head_dim=32, use_bias=True)),
}


@dataclass
class Case:
    arch: str
    hf: transformers.PreTrainedModel
    config: dict

    def fdx_model(self):
        weights = {k: v.detach().numpy().copy() for k, v in self.hf.state_dict().items()}
        return getattr(MODULES[self.arch], self.arch)({}, BuildContext(hf_config=self.config, weights=weights))

    def hf_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].numpy()


def build_case(name: str, seed: int = 0) -> Case:
    arch, overrides = CASES[name]
    torch.manual_seed(seed)
    hf_config = CONFIGS[arch](**{**COMMON, **overrides})
    hf = getattr(transformers, arch)(hf_config).eval()
    # transformers starts biases at 0 and norms at 1: randomize everything,
    # large enough that logits are far from ties.
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    config = hf.config.to_dict()
    config["architectures"] = [arch]
    return Case(arch, hf, config)


@pytest.fixture(scope="module", params=list(CASES))
def case(request) -> Case:
    return build_case(request.param)


class PagedRunner:
    """Drives a model the way the engine does: sequences with block tables
    over one paged pool, each step a batch of (sequence, new tokens)."""

    def __init__(self, model, num_blocks: int = 40, block_size: int = 4, seed: int = 0,
                 impl: str | None = None):
        if impl == "cpp" and not cpp.available():
            pytest.skip(f"compiled attention unavailable: {cpp.unavailable_reason()}")
        self.model, self.block_size, self.impl = model, block_size, impl
        self.attention = CpuAttention() if impl == "cpp" else REFERENCE_ATTENTION
        self.num_slots = num_blocks * block_size
        self.caches = allocate_kv_caches(model.num_layers, model.num_kv_heads, model.head_dim,
                                         num_blocks, block_size)
        self.free = [int(b) for b in np.random.default_rng(seed).permutation(num_blocks)]
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def step(self, batch: list[tuple[str, list[int]]], rows: str = "all") -> list[np.ndarray]:
        """Logits per sequence for rows "all" its new tokens, its "last" one, or "none"."""
        qlens, ctx, tables, tokens, wanted = [], [], [], [], []
        for sid, toks in batch:
            table, done = self.tables.setdefault(sid, []), self.lens.get(sid, 0)
            while len(table) * self.block_size < done + len(toks):
                table.append(self.free.pop())
            start = len(tokens)
            wanted.append({"all": list(range(start, start + len(toks))), "last": [start + len(toks) - 1],
                           "none": []}[rows])
            qlens.append(len(toks))
            ctx.append(done)
            tables.append(table)
            tokens += toks
            self.lens[sid] = done + len(toks)
        meta = build_attention_metadata(qlens, ctx, tables, self.block_size,
                                        self.model.num_kv_heads, self.num_slots, impl=self.impl)
        indices = [r for w in wanted for r in w]
        attn = AttentionContext(self.attention, meta)     # ops/ metadata of the impl under test
        logits = self.model.forward(paddle.to_tensor(tokens, dtype="int64"), meta.positions, self.caches,
                                    attn, paddle.to_tensor(indices, dtype="int64").reshape([-1])).numpy()
        assert logits.shape == (len(indices), self.model.vocab_size)
        splits = np.cumsum([len(w) for w in wanted])[:-1]
        return np.split(logits, splits)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, COMMON["vocab_size"], n).tolist()


ATOL = 1e-4
IMPLS = ["paddle", "cpp"]  # both attention paths of fdx.ops: eager Paddle, compiled kernel


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_logits_every_position(case, impl):
    ids = prompt(13, 1)
    (logits,) = PagedRunner(case.fdx_model(), impl=impl).step([("a", ids)])
    np.testing.assert_allclose(logits, case.hf_logits(ids), atol=ATOL, rtol=0)


def hf_greedy(case, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: n tokens, no eos stop."""
    case.hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = case.hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_greedy_generation_matches_transformers(case):
    ids = prompt(13, 2)
    expected = hf_greedy(case, ids, 32)
    runner, got = PagedRunner(case.fdx_model(), seed=3), []
    (logits,) = runner.step([("a", ids)], rows="last")
    for _ in range(32):
        got.append(int(logits[-1].argmax()))
        (logits,) = runner.step([("a", [got[-1]])], rows="last")
    assert got == expected
    assert len(set(got)) > 3  # a real trajectory, not one token repeated


def test_greedy_generation_through_the_one_call_for_all_layers(case, monkeypatch):
    """The cpu backend under this host's kernel table: every step (the prompt
    of 13 rows, then one row a step) runs all layers in one compiled call,
    biases (Qwen2, ERNIE, Llama's optional ones) and Qwen3's q/k norms
    included; the greedy tokens equal transformers', and the prompt's logits
    its within ATOL."""
    from fdx.core import kernels
    from test_contracts import cpu_kernel_table
    table = cpu_kernel_table()
    if not cpp.available() or not table.usable("cpp.decoder_layer"):
        pytest.skip(f"cpp.decoder_layer: {table.why_not('cpp.decoder_layer')}")
    calls = []
    real = cpp.decoder_stack
    monkeypatch.setattr(cpp, "decoder_stack", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = prompt(13, 2)
    expected = hf_greedy(case, ids, 16)
    with kernels.using(table):
        runner, got = PagedRunner(case.fdx_model(), seed=3, impl="cpp"), []
        (logits,) = runner.step([("a", ids)])
        np.testing.assert_allclose(logits, case.hf_logits(ids), atol=ATOL, rtol=0)
        for _ in range(16):
            got.append(int(logits[-1].argmax()))
            (logits,) = runner.step([("a", [got[-1]])], rows="last")
    assert got == expected
    assert len(calls) == 17                 # the prompt and every decode step


def test_chunked_prefill(case):
    ids = prompt(13, 4)
    runner = PagedRunner(case.fdx_model(), seed=5)
    chunks = [runner.step([("a", ids[i:i + 5])])[0] for i in range(0, 13, 5)]
    np.testing.assert_allclose(np.concatenate(chunks), case.hf_logits(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixed_batch_matches_solo_runs(case, impl):
    model = case.fdx_model()
    a, b, c = prompt(9, 6), prompt(11, 7), prompt(4, 8)
    a_next = prompt(1, 9)
    runner = PagedRunner(model, seed=10, impl=impl)
    runner.step([("a", a)], rows="last")
    runner.step([("b", b[:5])], rows="last")
    # One step: b's second chunk, a's decode, c's whole prompt.
    got_b, got_a, got_c = runner.step([("b", b[5:]), ("a", a_next), ("c", c)])

    solo = {}
    for sid, steps in {"a": [a, a_next], "b": [b[:5], b[5:]], "c": [c]}.items():
        r = PagedRunner(model, seed=11, impl=impl)
        solo[sid] = [r.step([(sid, s)]) for s in steps][-1][0]
    np.testing.assert_allclose(got_a, solo["a"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_b, solo["b"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_c, solo["c"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_a, case.hf_logits(a + a_next)[-1:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_b, case.hf_logits(b)[5:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_c, case.hf_logits(c), atol=ATOL, rtol=0)

    # Then all three decode together, at different lengths; ask for two rows only.
    nxt = {"a": 5, "b": 6, "c": 7}
    got = runner.step([(s, [t]) for s, t in nxt.items()])
    for (sid, tok), logits in zip(nxt.items(), got):
        full = {"a": a + a_next, "b": b, "c": c}[sid] + [tok]
        np.testing.assert_allclose(logits, case.hf_logits(full)[-1:], atol=ATOL, rtol=0)


def test_step_without_logits_rows():
    """A prefill chunk that samples nothing asks for no rows and still fills the cache."""
    case = build_case("llama-tied")
    ids = prompt(9, 12)
    runner = PagedRunner(case.fdx_model(), impl="paddle")    # quick subset: no kernel build on a fresh machine
    assert runner.step([("a", ids[:6])], rows="none")[0].shape == (0, COMMON["vocab_size"])
    (last,) = runner.step([("a", ids[6:])], rows="last")
    np.testing.assert_allclose(last, case.hf_logits(ids)[-1:], atol=ATOL, rtol=0)


# --- loading, config parsing and registration ---------------------------------

def test_weights_consumed_and_layout():
    case = build_case("qwen2-bias-untied")
    weights = {k: v.detach().numpy().copy() for k, v in case.hf.state_dict().items()}
    model = qwen2.Qwen2ForCausalLM({}, BuildContext(hf_config=case.config, weights=weights))
    assert weights == {}  # every tensor converted and released
    attn, mlp = model.layers[0].attn, model.layers[0].mlp
    # LinearWeight shapes are (out, in); the float32 format keeps [in, out] tensors underneath
    assert attn.wqkv.shape == ((4 + 2 * 2) * 16, 64) and attn.wqkv.t.shape == [64, 128]
    assert attn.bqkv.shape == [128]
    assert attn.wo.shape == (64, 64) and attn.bo is None
    assert mlp.w_gate_up.shape == (256, 64) and mlp.w_down.t.shape == [128, 64]
    assert model.lm_head.t.shape == [64, 256]
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.vocab_size,
            model.max_position_embeddings) == (2, 2, 16, 256, 128)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.up_proj.weight", "lm_head.weight",
                                     "model.layers.0.self_attn.k_proj.bias", "model.norm.weight"])
def test_missing_weight_is_named(missing):
    case = build_case("qwen2-bias-untied")
    weights = {k: v.detach().numpy() for k, v in case.hf.state_dict().items()}
    del weights[missing]
    with pytest.raises(ValueError, match=f"missing weight '{missing}'"):
        qwen2.Qwen2ForCausalLM({}, BuildContext(hf_config=case.config, weights=weights))


def test_wrong_shape_is_named():
    case = build_case("llama-tied")
    weights = {k: v.detach().numpy() for k, v in case.hf.state_dict().items()}
    weights["model.layers.0.self_attn.o_proj.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(ValueError, match=r"o_proj.weight' has shape \(64, 32\), expected \(64, 64\)"):
        llama.LlamaForCausalLM({}, BuildContext(hf_config=case.config, weights=weights))


def test_tied_model_without_lm_head_in_weights():
    case = build_case("qwen3-tied-hd32")
    weights = {k: v.detach().numpy().copy() for k, v in case.hf.state_dict().items()}
    weights.pop("lm_head.weight", None)
    model = qwen3.Qwen3ForCausalLM({}, BuildContext(hf_config=case.config, weights=weights))
    (logits,) = PagedRunner(model, impl="paddle").step([("a", [5, 6, 7])])
    np.testing.assert_allclose(logits, case.hf_logits([5, 6, 7]), atol=ATOL, rtol=0)


MINIMAL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4)


@pytest.mark.parametrize("arch", list(MODULES))
def test_config_defaults_match_transformers(arch):
    """Keys a config.json leaves out take transformers' defaults.

    (Not num_key_value_heads: a missing one means MHA here, as in Llama;
    Qwen2/Qwen3/ERNIE's config classes default it to a fixed 32 or 2.)"""
    ours = getattr(MODULES[arch], arch).parse_config(dict(MINIMAL))
    theirs = CONFIGS[arch](**MINIMAL)
    # the modeling code's own rule: config.head_dim, else hidden_size // heads
    assert ours.head_dim == (getattr(theirs, "head_dim", None) or 64 // 4)
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.max_position_embeddings == theirs.max_position_embeddings


@pytest.mark.parametrize("arch", list(MODULES))
def test_null_head_dim_means_hidden_over_heads(arch):
    ours = getattr(MODULES[arch], arch).parse_config({**MINIMAL, "head_dim": None})
    assert ours.head_dim == 64 // 4


def test_transformers4_style_rope_keys():
    cfg = llama.LlamaForCausalLM.parse_config({**MINIMAL, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["factor"] == 8.0
    cfg = qwen2.Qwen2ForCausalLM.parse_config({**MINIMAL, "rope_theta": 1e6, "rope_scaling": None})
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_transformers4_config_dict_runs_the_same_model():
    """The same checkpoint described with 4.x keys (rope_theta, rope_scaling)."""
    case = build_case("llama-untied-bias-llama3")
    params = case.config.pop("rope_parameters")
    case.config["rope_theta"] = params.pop("rope_theta")
    case.config["rope_scaling"] = params
    ids = prompt(40, 13)  # past original_max_position_embeddings=32
    (logits,) = PagedRunner(case.fdx_model(), impl="paddle").step([("a", ids)])
    np.testing.assert_allclose(logits, case.hf_logits(ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("scaling", [
    {"rope_scaling": {"type": "linear", "factor": 2.0}},
    {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
])
def test_unsupported_rope_scaling_raises(scaling):
    with pytest.raises(NotImplementedError, match="rope scaling type '(linear|yarn)'"):
        qwen2.Qwen2ForCausalLM.parse_config({**MINIMAL, **scaling})


def test_unsupported_features_raise():
    with pytest.raises(NotImplementedError, match="sliding-window"):
        qwen2.Qwen2ForCausalLM.parse_config({**MINIMAL, "use_sliding_window": True, "max_window_layers": 0})
    with pytest.raises(NotImplementedError, match="hidden_act 'gelu'"):
        llama.LlamaForCausalLM.parse_config({**MINIMAL, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="missing 'vocab_size'"):
        llama.LlamaForCausalLM.parse_config({k: v for k, v in MINIMAL.items() if k != "vocab_size"})


def test_each_module_registers_its_architecture():
    for arch, module in MODULES.items():
        seen = {}
        module.fdx_register_models(lambda name, cls: seen.setdefault(name, cls))
        assert seen == {arch: getattr(module, arch)}
