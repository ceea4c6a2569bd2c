"""The MoE architectures (Qwen3-MoE, ERNIE-4.5-MoE) against Hugging Face
transformers (torch, float32) on tiny random checkpoints the tests write:
a Hugging Face folder (transformers' own save_pretrained, which stores the
experts one by one as the hub's checkpoints do) and the same weights as a
GGUF file the way llama.cpp's convert_hf_to_gguf.py writes one (experts
stacked in 3-D ``ffn_*_exps`` tensors, ``ffn_gate_inp`` router,
``ffn_*_shexp`` shared experts, ``exp_probs_b`` bias, the converter's
metadata keys), in F32 and Q8_0.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
import pytest
import torch
import transformers

from fdx.core.interfaces import BuildContext
from fdx.model_io.loader import load_checkpoint
from fdx.plugins.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM
from fdx.plugins.models.qwen2_moe import Qwen2MoeForCausalLM
from fdx.plugins.models.qwen3_moe import Qwen3MoeForCausalLM
from test_models import PagedRunner

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=0, eos_token_id=1, pad_token_id=2)
CASES = {  # id -> (architecture, transformers config overrides)
    # layer 1 dense (mlp_only_layers), top-2 of 8 renormalized, untied head
    "qwen3moe": ("Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=8, num_experts_per_tok=2,
                                             norm_topk_prob=True, mlp_only_layers=[1], rms_norm_eps=1e-6,
                                             tie_word_embeddings=False, rope_parameters={
                                                 "rope_type": "default", "rope_theta": 1e6})),
    # layer 0 dense (moe_layer_start_index 1), top-2 of 8, one shared expert, tied head
    "ernie-moe": ("Ernie4_5_MoeForCausalLM", dict(moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                                                  moe_layer_start_index=1, use_bias=False,
                                                  tie_word_embeddings=True)),
    # q/k/v biases, a shared expert behind its sigmoid gate, top-2 of 8 not renormalized, layer 2 dense
    "qwen2moe": ("Qwen2MoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                                             shared_expert_intermediate_size=64, mlp_only_layers=[2],
                                             tie_word_embeddings=False, rms_norm_eps=1e-6)),
    # biases everywhere (head included), two shared experts, every layer routed, top-3
    "ernie-moe-bias": ("Ernie4_5_MoeForCausalLM", dict(moe_num_experts=8, moe_k=3, moe_num_shared_experts=2,
                                                       moe_layer_start_index=0, use_bias=True,
                                                       tie_word_embeddings=False, num_hidden_layers=2)),
}
CLASSES = {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM, "Ernie4_5_MoeForCausalLM": Ernie4_5_MoeForCausalLM,
           "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM}
GGUF_ARCH = {"Qwen3MoeForCausalLM": "qwen3moe", "Ernie4_5_MoeForCausalLM": "ernie4_5-moe",
             "Qwen2MoeForCausalLM": "qwen2moe"}
ATOL = 1e-4


@dataclass
class Case:
    name: str
    arch: str
    hf: transformers.PreTrainedModel
    path: Path                  # the Hugging Face folder

    def logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0].numpy()

    def fdx_model(self):
        ck = load_checkpoint(str(self.path), progress=False)
        return CLASSES[self.arch]({}, BuildContext(hf_config=ck.config, weights=ck.weights))


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def write_case(name: str, root: Path, seed: int = 0) -> Case:
    arch, overrides = CASES[name]
    torch.manual_seed(seed)
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**COMMON, **overrides})
    hf = getattr(transformers, arch)(cfg).eval()
    # random everything (norms near 1, the expert-choice bias on the scale of the probabilities,
    # so that it changes which experts are chosen), far enough from ties
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "e_score_correction_bias" in pname:
                p.copy_(0.1 * torch.randn_like(p))
            elif "norm" in pname:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif pname.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    path = root / name
    hf.save_pretrained(str(path))
    _tokenizer(path)
    return Case(name, arch, hf, path)


# --- the GGUF file, as llama.cpp's converter writes it -------------------------------------

def write_gguf(case: Case, out: Path, qtype: str = "F32") -> Path:
    """The case's HF folder as a GGUF file: experts stacked per projection,
    llama.cpp's tensor names (gguf-py's tables) and metadata keys; Q8_0
    quantizes every matrix but the router (the converter keeps
    ``ffn_gate_inp`` in F32), 1-D tensors stay F32."""
    import gguf
    from gguf.quants import quantize
    from safetensors.numpy import load_file

    config = json.loads((case.path / "config.json").read_text())
    weights = load_file(str(case.path / "model.safetensors"))
    arch = GGUF_ARCH[case.arch]
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    dense = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    w = gguf.GGUFWriter(str(out), arch)
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    w.add_block_count(layers)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if "head_dim" in config:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("qwen2moe", "qwen3moe"):     # Qwen2MoeModel.set_gguf_parameters
        w.add_expert_count(config.get("num_experts") or config["num_local_experts"])
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in config:
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    else:                                    # Ernie4_5MoeModel.set_gguf_parameters
        w.add_expert_count(config["moe_num_experts"])
        w.add_expert_used_count(config["moe_k"])
        w.add_interleave_moe_layer_step(config["moe_layer_interval"])
        w.add_leading_dense_block_count(config["moe_layer_start_index"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_count(config["moe_num_shared_experts"])
        w.add_expert_shared_feed_forward_length(config["intermediate_size"] // kv)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(VOCAB)])
    w.add_token_types([1] * VOCAB)
    w.add_token_merges([])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def add(name: str, array: np.ndarray) -> None:
        array = np.ascontiguousarray(array, dtype=np.float32)
        if qtype == "Q8_0" and array.ndim >= 2 and not any(  # the converter keeps these in F32
                f".{t}." in name for t in ("ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b")):
            w.add_tensor(name, quantize(array, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, array)

    experts = {}
    for hf_name, array in weights.items():
        parts = hf_name.split(".")
        if ".mlp.experts." in hf_name:       # model.layers.N.mlp.experts.E.gate_proj.weight
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = array
            continue
        if hf_name.endswith("e_score_correction_bias"):   # the converter's rename, then name map
            hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        # (llama.cpp's qwen3moe has no dense layers: a mlp_only_layers MLP takes the dense names)
        add(names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
            or dense.get_name(hf_name, try_suffixes=(".weight", ".bias")), array)
    for (layer, proj), per_expert in sorted(experts.items()):
        stacked = np.stack([per_expert[e] for e in sorted(per_expert)])
        add(names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",)), stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return write_case(request.param, tmp_path_factory.mktemp("moe"))


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


# --- the model against transformers ---------------------------------------------------------

def test_prefill_logits_every_position(case):
    ids = prompt(13, 1)
    (logits,) = PagedRunner(case.fdx_model(), impl="paddle").step([("a", ids)])
    np.testing.assert_allclose(logits, case.logits(ids), atol=ATOL, rtol=0)


def test_routing_is_the_checkpoints(case):
    """The router picks what transformers' router picks, and the config's
    dense layers stay dense."""
    model = case.fdx_model()
    moe = model.moe
    hf_cfg = case.hf.config
    routed = [i for i, layer in enumerate(case.hf.model.layers) if hasattr(layer.mlp, "gate")
              and hasattr(layer.mlp, "experts")]
    assert list(moe.moe_layers) == routed and 0 < len(routed)
    assert moe.num_experts == hf_cfg.num_experts and moe.top_k == hf_cfg.num_experts_per_tok
    x = torch.randn(7, hf_cfg.hidden_size)
    for i in routed:
        with torch.no_grad():
            _, hf_weights, hf_ids = case.hf.model.layers[i].mlp.gate(x)
        ids, weights = model.layers[i].mlp.route(paddle.to_tensor(x.numpy()))
        assert (ids == hf_ids.numpy()).all()
        np.testing.assert_allclose(weights, hf_weights.numpy(), atol=1e-6, rtol=0)
        assert model.layers[i].fused is None        # never the backend's fused layer


def test_chunked_prefill_and_mixed_batch(case):
    model = case.fdx_model()
    a, b, c = prompt(9, 6), prompt(11, 7), prompt(4, 8)
    runner = PagedRunner(model, seed=10, impl="paddle")
    chunks = [runner.step([("b", b[i:i + 4])])[0] for i in range(0, 8, 4)]
    runner.step([("a", a)], rows="none")
    # one step: b's last chunk, a's decode, c's whole prompt
    got_b, got_a, got_c = runner.step([("b", b[8:]), ("a", [5]), ("c", c)])
    np.testing.assert_allclose(np.concatenate(chunks + [got_b]), case.logits(b), atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_a, case.logits(a + [5])[-1:], atol=ATOL, rtol=0)
    np.testing.assert_allclose(got_c, case.logits(c), atol=ATOL, rtol=0)


def test_greedy_matches_transformers(case):
    from test_llm import hf_greedy
    ids = prompt(10, 2)
    runner, got = PagedRunner(case.fdx_model(), seed=3, impl="paddle"), []
    (logits,) = runner.step([("a", ids)], rows="last")
    for _ in range(16):
        got.append(int(logits[-1].argmax()))
        (logits,) = runner.step([("a", [got[-1]])], rows="last")
    assert got == hf_greedy(case.hf, ids, 16, follow=got)
    assert len(set(got)) > 3


def test_missing_expert_is_named(case):
    ck = load_checkpoint(str(case.path), progress=False)
    layer = CLASSES[case.arch].parse_moe_config(ck.config).moe_layers[-1]
    name = f"model.layers.{layer}.mlp.experts.5.down_proj.weight"
    del ck.weights[name]
    with pytest.raises(ValueError, match=f"missing weight '{name}'"):
        CLASSES[case.arch]({}, BuildContext(hf_config=ck.config, weights=ck.weights))


def test_bad_top_k_is_a_clear_error():
    cfg = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        from fdx.plugins.models.moe_decoder import check_moe
        check_moe("Qwen3MoeForCausalLM", 2, Qwen3MoeForCausalLM.parse_moe_config(cfg))


# --- GGUF ---------------------------------------------------------------------------------

GGUF_CASES = ["qwen3moe", "ernie-moe", "qwen2moe"]


@pytest.fixture(scope="module", params=GGUF_CASES)
def gguf_case(request, tmp_path_factory) -> tuple[Case, Path, Path]:
    root = tmp_path_factory.mktemp("moe_gguf")
    c = write_case(request.param, root)
    return c, write_gguf(c, root / f"{c.name}.f32.gguf"), write_gguf(c, root / f"{c.name}.q8_0.gguf", "Q8_0")


@pytest.mark.slow                   # builds a torch reference model (conftest's rule)
def test_gguf_f32_config_and_logits(gguf_case):
    case, f32, _ = gguf_case
    hf_ck = load_checkpoint(str(case.path), progress=False)
    ck = load_checkpoint(str(f32), progress=False)
    assert ck.architecture == case.arch
    cls = CLASSES[case.arch]
    assert cls.parse_moe_config(ck.config) == cls.parse_moe_config(hf_ck.config)
    got, want = cls.parse_config(ck.config), cls.parse_config(hf_ck.config)
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-6)       # a float32 in the file
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want
    assert set(ck.weights) == set(hf_ck.weights)
    ids = prompt(12, 3)
    (logits,) = PagedRunner(cls({}, BuildContext(hf_config=ck.config, weights=ck.weights)), impl="paddle").step([("a", ids)])
    np.testing.assert_allclose(logits, case.logits(ids), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_gguf_q8_0_experts_stay_quantized(gguf_case, tmp_path):
    """Q8_0 experts are held as Q8_0 blocks (each expert its rows of the
    stacked tensor) and multiply through the format's product; the logits
    are those of transformers on the dequantized weights, within the Q8_0
    product's rounding (the kernels quantize activations too)."""
    import shutil

    from safetensors.numpy import save_file

    from fdx.plugins.models.weight_formats import AutoFormat, BlockWeight
    case, _, q8 = gguf_case
    ck = load_checkpoint(str(q8), progress=False, keep_blocks=True)
    model = CLASSES[case.arch]({}, BuildContext(hf_config=ck.config, weights=ck.weights,
                                                   weight_format=AutoFormat()))
    block = model.layers[model.moe.moe_layers[0]].mlp
    assert all(isinstance(w, BlockWeight) and w.kind == "q8_0" for w in block.w_gate_up + block.w_down)
    # the reference: transformers on the file's values (dequantized by the gguf package)
    ref = load_checkpoint(str(q8), progress=False)
    folder = tmp_path / "dequantized"
    folder.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in ref.weights.items()}, str(folder / "model.safetensors"))
    shutil.copy(case.path / "config.json", folder / "config.json")
    hf = type(case.hf).from_pretrained(str(folder)).eval()
    ids = prompt(12, 4)
    (logits,) = PagedRunner(model, impl="paddle").step([("a", ids)])
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    spread = float(expected.max() - expected.min())
    assert np.abs(logits - expected).max() < 0.02 * spread


# --- through the engine ------------------------------------------------------------------------

@pytest.mark.slow
def test_engine_batch_chunked_preempted_prefix_hits_equal_transformers(gguf_case):
    """Many requests at once over a few KV blocks (preemption), a small step
    budget (chunked prefill, mixed steps), a shared prefix (prefix cache
    hits): every greedy output equals transformers', and the GGUF F32 file
    gives the same tokens as the folder."""
    from fdx import LLM, SamplingParams
    from fdx.core.hookspecs import hookimpl
    from test_llm import hf_greedy

    class Recorder:
        def __init__(self):
            self.stats = []

        @hookimpl
        def fdx_step_finished(self, scheduler_output, step_stats):
            self.stats.append(step_stats)

    case, f32, _ = gguf_case
    rng = np.random.default_rng(5)
    shared = rng.integers(3, VOCAB, 12).tolist()
    prompts = [shared + rng.integers(3, VOCAB, n).tolist() for n in (3, 9, 1, 14, 6, 2)]
    prompts += [rng.integers(3, VOCAB, n).tolist() for n in (5, 17)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for source in (case.path, f32):
        llm = LLM(str(source), max_model_len=64, max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=20,
                  block_size=4, kv_cache="prefix", quantization="none", progress=False)
        rec = Recorder()
        llm.engine.plugins.pm.register(rec)
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        finally:
            llm.engine.plugins.pm.unregister(rec)
        outputs[source] = [o.outputs[0].token_ids for o in outs]
        assert sum(s.num_preempted for s in rec.stats) > 0                 # preemption happened
        assert max(s.num_scheduled_tokens for s in rec.stats) <= 16         # chunked to the budget
        assert any(o.num_cached_tokens > 0 for o in outs)                   # prefix hits
        # the expert-load tap: every routed row of the step counted top_k times in each MoE layer
        moe = llm.engine.model.moe
        ran = [s for s in rec.stats if s.num_scheduled_tokens]
        assert ran and all(len(s.expert_load) == len(moe.moe_layers) for s in ran)
        assert all(sum(layer) == s.num_scheduled_tokens * moe.top_k for s in ran for layer in s.expert_load)
        llm.close()
    for p, got in zip(prompts, outputs[case.path]):
        assert got == hf_greedy(case.hf, p, 12, follow=got)
    assert outputs[f32] == outputs[case.path]


# --- tensor parallel ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
def test_tensor_parallel_shards_sum_to_the_whole_layer(tmp_path, groups):
    """Each rank keeps its share of every expert's (and the shared experts')
    intermediate columns, or (expert parallel, ``groups`` 2) half the experts
    whole and its share of the shared experts' columns; the ranks' partial
    outputs of a MoE MLP sum to the whole one (the bias of the shared down
    projection added once)."""
    case = write_case("ernie-moe-bias", tmp_path)
    whole, ranks = case.fdx_model(), [case.fdx_model() for _ in range(2)]
    for r, model in enumerate(ranks):
        model.shard(r, 2, lambda t: t, groups)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((9, 64)).astype(np.float32))
    for i in whole.moe.moe_layers:
        block = whole.layers[i].mlp
        assert ranks[0].layers[i].mlp.w_down[0].shape == (64, 32 // (2 // groups))
        assert len(ranks[0].layers[i].mlp.w_down) == 8 // groups
        got = ranks[0].layers[i].mlp(x) + ranks[1].layers[i].mlp(x) - block.shared.b_down
        np.testing.assert_allclose(got.numpy(), block(x).numpy(), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_tp2_greedy_equals_tp1(tmp_path):
    """Greedy tokens, and each step's expert load (StepStats.expert_load: rank
    0 sends it back under tensor parallel), equal one rank's."""
    from fdx import LLM, SamplingParams
    from fdx.core.hookspecs import hookimpl

    class Loads(list):
        @hookimpl
        def fdx_step_finished(self, scheduler_output, step_stats):
            self.append(step_stats.expert_load)

    case = write_case("ernie-moe-bias", tmp_path)
    ps = [prompt(n, 20 + n) for n in (4, 11)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    kw = dict(max_model_len=64, num_kv_blocks=32, block_size=4, quantization="none", progress=False)
    out, loads = {}, {}
    for tp in (1, 2):
        with LLM(str(case.path), tensor_parallel_size=tp, **kw) as llm:
            loads[tp] = seen = Loads()
            llm.engine.plugins.pm.register(seen)
            try:
                out[tp] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp)]
            finally:
                llm.engine.plugins.pm.unregister(seen)
    assert out[2] == out[1]
    assert loads[2] == loads[1] and len(loads[1]) >= 8 and all(load is not None for load in loads[1])


# --- research taps: expert load and a replaced router ---------------------------------------------

@pytest.mark.slow
def test_expert_load_and_a_replaced_router(tmp_path):
    """``last_expert_load()``: the tokens each expert got in each MoE layer
    by the last forward, equal to a brute-force count of transformers'
    router choices; ``set_router`` replaces the top-k choice (here: always
    experts 0 and 1, equal weights), and the logits follow it."""
    case = write_case("qwen3moe", tmp_path)
    model = case.fdx_model()
    ids = prompt(10, 9)
    runner = PagedRunner(model, impl="paddle")
    runner.step([("a", ids)])
    captured = {}
    hooks = [case.hf.model.layers[i].mlp.gate.register_forward_hook(
        lambda mod, inp, out, i=i: captured.__setitem__(i, out[2].numpy())) for i in model.moe.moe_layers]
    case.logits(ids)
    for h in hooks:
        h.remove()
    want = [np.bincount(captured[i].reshape(-1), minlength=model.moe.num_experts).tolist()
            for i in model.moe.moe_layers]
    assert model.last_expert_load() == want
    assert all(sum(layer) == len(ids) * model.moe.top_k for layer in want)

    def first_two(logits, bias):
        n = logits.shape[0]
        return np.tile(np.array([0, 1]), (n, 1)), np.full((n, 2), 0.5, np.float32)
    model.set_router(first_two)
    (logits,) = PagedRunner(model, impl="paddle").step([("a", ids)])
    assert model.last_expert_load() == [[len(ids), len(ids)] + [0] * 6 for _ in model.moe.moe_layers]
    for i in model.moe.moe_layers:                   # the same choice in transformers
        case.hf.model.layers[i].mlp.gate.forward = lambda x, i=i: (
            None, torch.full((x.reshape(-1, 64).shape[0], 2), 0.5),
            torch.tensor([[0, 1]]).repeat(x.reshape(-1, 64).shape[0], 1))
    try:
        np.testing.assert_allclose(logits, case.logits(ids), atol=ATOL, rtol=0)
    finally:
        for i in model.moe.moe_layers:
            del case.hf.model.layers[i].mlp.gate.forward


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["q8_0", "wint8", "wint4"])
def test_quantized_on_load_experts_stay_quantized(fmt, tmp_path):
    """A float checkpoint under a quantizing weight format: each expert is
    held in that format and multiplied by its product; the logits stay near
    transformers' float ones (the formats' rounding; wint4's is too coarse
    on these tiny random weights for a bound, so there only that it runs)."""
    from fdx.plugins.models.weight_formats import FORMATS, BlockWeight
    case = write_case("ernie-moe", tmp_path)
    ck = load_checkpoint(str(case.path), progress=False)
    model = CLASSES[case.arch]({}, BuildContext(hf_config=ck.config, weights=ck.weights,
                                                   weight_format=FORMATS[fmt]()))
    block = model.layers[model.moe.moe_layers[0]].mlp
    assert all(isinstance(w, BlockWeight) and w.kind == fmt for w in block.w_gate_up + block.w_down)
    assert fmt in model.weight_bytes()
    ids = prompt(12, 4)
    (logits,) = PagedRunner(model, impl="paddle").step([("a", ids)])
    expected = case.logits(ids)
    assert np.isfinite(logits).all()
    if fmt != "wint4":
        assert np.abs(logits - expected).max() < 0.05 * float(expected.max() - expected.min())


@pytest.mark.slow
def test_an_outside_router_replaces_top_k(tmp_path, monkeypatch):
    """``model.moe_router`` names a router an outside package registers
    (tests/plugin_pkg's ``example-uniform``: top-k by logit, equal
    weights): the engine's greedy tokens equal transformers' with its
    router's weights replaced the same way; an unknown name is a config
    error naming the key."""
    import sys

    from conftest import PLUGIN_PKG
    from fdx import LLM, SamplingParams
    from fdx.core.config import ConfigError
    from fdx.core.plugins import BUILTIN_PLUGINS, PluginManager
    from test_llm import hf_greedy
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    pm = PluginManager(builtins=BUILTIN_PLUGINS + ("fdx_example_plugin.moe_router",), load_entry_points=False)
    case = write_case("qwen3moe", tmp_path)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    kw = dict(max_model_len=64, num_kv_blocks=32, block_size=4, quantization="none", progress=False)
    with LLM(str(case.path), moe_router="example-uniform", plugins=pm, **kw) as llm:
        ps = [prompt(7, 31), prompt(12, 32)]
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp)]
    assert got != [hf_greedy(case.hf, p, 10) for p in ps]       # the router's own choice gives other tokens
    k = case.hf.config.num_experts_per_tok
    for layer in case.hf.model.layers:
        if hasattr(layer.mlp, "experts"):
            def uniform(x, gate=layer.mlp.gate):
                logits = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), gate.weight)
                ids = logits.topk(k, dim=-1).indices
                return logits, torch.full(ids.shape, 1.0 / k), ids
            monkeypatch.setattr(layer.mlp.gate, "forward", uniform)
    for p, g in zip(ps, got):
        assert g == hf_greedy(case.hf, p, 10, follow=g)
    with pytest.raises(ConfigError, match="model.moe_router"):
        LLM(str(case.path), moe_router="no-such-router", plugins=pm, **kw)
    assert "example-uniform" in pm.names("moe_router") and sys.modules["fdx_example_plugin.moe_router"]


@pytest.mark.slow
def test_a_router_out_of_range_is_named(tmp_path):
    case = write_case("ernie-moe", tmp_path)
    model = case.fdx_model()
    model.set_router(lambda logits, bias: (np.full((logits.shape[0], 2), 8), np.ones((logits.shape[0], 2))))
    with pytest.raises(ValueError, match=r"model.moe_router.*\[0, 8\)"):
        PagedRunner(model, impl="paddle").step([("a", [5, 6, 7])])


def test_which_layers_route():
    """transformers' rules: Qwen3-MoE routes every decoder_sparse_step-th
    layer outside mlp_only_layers; ERNIE routes layers start..end (-1: the
    last) every moe_layer_interval-th, its shared experts one MLP of
    moe_intermediate_size * moe_num_shared_experts."""
    q = Qwen3MoeForCausalLM.parse_moe_config(dict(num_hidden_layers=6, num_experts=4, num_experts_per_tok=2,
                                                  decoder_sparse_step=2, mlp_only_layers=[3]))
    assert q.moe_layers == (1, 5) and q.shared_intermediate_size == 0 and not q.norm_topk_prob
    e = Ernie4_5_MoeForCausalLM.parse_moe_config(dict(num_hidden_layers=8, moe_num_experts=4, moe_k=2,
                                                      moe_layer_start_index=2, moe_layer_end_index=6,
                                                      moe_layer_interval=2, moe_intermediate_size=16,
                                                      moe_num_shared_experts=2))
    assert e.moe_layers == (3, 5) and e.shared_intermediate_size == 32 and e.score_correction_bias
    with pytest.raises(NotImplementedError, match="moe_num_experts"):
        Ernie4_5_MoeForCausalLM.parse_moe_config(dict(num_hidden_layers=2, moe_num_experts=[4, 4]))
