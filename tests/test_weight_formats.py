"""Weight formats (model.quantization) end to end, against transformers run
on the values the quantized weights stand for.

Tiny random Llamas are written as GGUF by the test (gguf.GGUFWriter,
llama.cpp's Q/K row permutation included) with linear weights in Q8_0,
Q4_0, Q4_1 (gguf.quants.quantize) and, for a mixed file, Q4_K and Q6_K
(random blocks: the gguf package has no quantizer for them). The reference
is transformers with each weight replaced by gguf's dequantization of the
same bytes (wint8/wint4: a numpy quantization written here), so every
comparison is with an independent implementation. Greedy tokens follow the
reference at a float32 near-tie (test_llm.hf_greedy).
"""
from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from fdx import LLM, SamplingParams
from fdx.core.config import ConfigError
from test_llm import hf_greedy
from test_loader import _write_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TINY = dict(max_model_len=128, num_kv_blocks=64, block_size=8, progress=False)
VOCAB = 256
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def tiny_llama(tie: bool, seed: int) -> transformers.LlamaForCausalLM:
    """hidden 256 (one Q4_K/Q6_K block), 4 heads / 2 KV heads, 2 layers."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie,
                                   initializer_range=0.05)
    return transformers.LlamaForCausalLM(cfg).eval()


def random_blocks(kind: T, rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K / Q6_K blocks with small scales (weights of ~0.05)."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    if kind == T.Q4_K:       # d, dmin (f16) then 12 bytes of 6-bit scales, 128 of 4-bit values
        data[..., 0:2] = np.full(data.shape[:2], 2e-4, np.float16)[..., None].view(np.uint8)
        data[..., 2:4] = np.full(data.shape[:2], 1e-4, np.float16)[..., None].view(np.uint8)
    elif kind == T.Q6_K:     # 128 + 64 bytes of 6-bit values, 16 int8 scales, d (f16)
        data[..., 208:210] = np.full(data.shape[:2], 2e-5, np.float16)[..., None].view(np.uint8)
    else:
        raise ValueError(kind)
    return data.reshape(rows, -1)


def quantized_gguf(path: pathlib.Path, model, kind_of) -> pathlib.Path:
    """Write ``model`` as a GGUF whose 2-D tensors are in ``kind_of(name)``
    (None: F32), and make the model hold what the file's bytes stand for
    (gguf's dequantization): the reference."""
    rng = np.random.default_rng(0)
    blocks, state = {}, model.state_dict()
    for name, tensor in state.items():
        tied_head = name == "lm_head.weight" and model.config.tie_word_embeddings
        kind = kind_of(name) if tensor.ndim == 2 and not tied_head else None
        if kind is None:
            continue
        w = tensor.detach().float().numpy()
        data = random_blocks(kind, *w.shape, rng) if kind in (T.Q4_K, T.Q6_K) else quantize(w, kind)
        blocks[name] = (data, kind)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(dequantize(data, kind).reshape(w.shape)))
    _write_gguf(path, "llama", model, permute_qk=True, tokens=[chr(0x100 + i) for i in range(VOCAB)], blocks=blocks)
    return path


def mixed_kind(name: str):
    """A file like llama.cpp's Q4_K_M: several types, fused parts differing."""
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
    if name == "model.embed_tokens.weight":
        return T.Q8_0
    table = {"q_proj": T.Q4_K, "k_proj": T.Q4_K, "v_proj": T.Q6_K if layer == 0 else T.Q4_K,
             "o_proj": T.Q8_0 if layer == 0 else T.Q4_K, "gate_proj": T.Q4_0, "up_proj": T.Q4_1 if layer == 0 else T.Q4_0,
             "down_proj": T.Q6_K}
    return next(kind for part, kind in table.items() if f".{part}." in name)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> (GGUF path, reference transformers model)."""
    d = tmp_path_factory.mktemp("wf")
    out = {}
    for i, (name, kind) in enumerate((("q8_0", T.Q8_0), ("q4_0", T.Q4_0), ("q4_1", T.Q4_1))):
        model = tiny_llama(tie=False, seed=10 + i)
        out[name] = (quantized_gguf(d / f"{name}.gguf", model, lambda n, k=kind: k), model)
    model = tiny_llama(tie=True, seed=20)
    out["mixed"] = (quantized_gguf(d / "mixed.gguf", model, mixed_kind), model)
    model = tiny_llama(tie=False, seed=30)
    out["f32"] = (quantized_gguf(d / "f32.gguf", model, lambda n: None), model)
    return out


def prompts(seed: int, lens=(5, 17, 2)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, n).tolist() for n in lens]


# The compiled quantized products quantize the activations to int8 per block of 32 (as
# llama.cpp does): about 5e-3 of a product's largest output (tests/test_quant_kernels.py).
# Through a model that moves a logit by a fraction of the logits' range (measured: 0.3% on
# the tiny models, 0.7% on SmolLM2 at TP 3), so a top-two gap under QUANT_TIE of that range
# is a tie the reference follows; a wrong kernel moves the logits far more.
QUANT_TIE = 0.015


def check_greedy(llm: LLM, model, batch: list[list[int]], rel_tie: float = QUANT_TIE) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    for p, out in zip(batch, outs):
        got = out.outputs[0].token_ids
        assert got == hf_greedy(model, p, GREEDY.max_tokens, follow=got, rel_tie=rel_tie), p


# --- auto: each GGUF tensor in its own type -----------------------------------------------

@pytest.mark.parametrize("name", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow),
                                  pytest.param("q4_1", marks=pytest.mark.slow), "mixed"])
def test_auto_keeps_each_type_and_matches_the_dequantized_reference(files, name):
    path, model = files[name]
    llm = LLM(str(path), quantization="auto", **TINY)
    held = llm.engine.model.weight_bytes()
    want = {"q8_0", "q4_k", "q6_k", "q4_0", "q4_1"} if name == "mixed" else {name}
    assert set(held) == want | {"f32"}                  # f32: the norms only
    assert held["f32"] == 4 * 256 * (2 * 2 + 1)
    check_greedy(llm, model, prompts(0))                # three prompts batched


def test_blocks_kept_by_the_loader_are_the_float_loaders_values(files):
    """keep_blocks: the file's bytes, Q/K rows un-permuted by a row gather on
    them; gguf's dequantization of those equals the float32 load."""
    from fdx.model_io.loader import GGUFBlocks, load_checkpoint
    path, _ = files["mixed"]
    blocks = load_checkpoint(str(path), progress=False, keep_blocks=True).weights
    floats = load_checkpoint(str(path), progress=False).weights
    assert blocks.keys() == floats.keys()
    kinds = set()
    for name, ref in floats.items():
        b = blocks[name]
        if ref.ndim == 1:
            assert isinstance(b, np.ndarray)
            continue
        assert isinstance(b, GGUFBlocks) and b.shape == ref.shape, name
        kinds.add(b.kind)
        np.testing.assert_array_equal(dequantize(b.data, T[b.kind.upper()]), ref, err_msg=name)
        np.testing.assert_array_equal(b.dequantize(), ref, err_msg=name)   # what auto gives a float32-only class
    assert kinds == {"q8_0", "q4_k", "q6_k", "q4_0", "q4_1"}


# --- auto, the default, on float checkpoints: what none gives -------------------------------

def test_auto_is_the_default_and_holds_a_float_checkpoint_as_none_does(files, tiny_checkpoints, tmp_path):
    """model.quantization defaults to auto; on an fp32 or bf16 safetensors
    folder and on an F32 GGUF it holds float32 weights, the same bytes as
    none, and its greedy tokens equal transformers' on those values."""
    from fdx.core.config import FdxConfig
    assert FdxConfig.build().model.quantization == "auto"
    hf_dir, hf_model = tiny_checkpoints["LlamaForCausalLM"]
    import copy
    import shutil
    bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    bf16.save_pretrained(str(tmp_path / "bf16"), safe_serialization=True)
    for f in pathlib.Path(hf_dir).glob("tokenizer*"):
        shutil.copy(f, tmp_path / "bf16" / f.name)
    bf16_ref = bf16.float()                        # bf16 values held in float32: what fdx loads
    for path, model, vocab in ((hf_dir, hf_model, 49152), (tmp_path / "bf16", bf16_ref, 49152),
                               (files["f32"][0], files["f32"][1], VOCAB)):
        auto = LLM(str(path), **TINY)                 # no quantization given
        none = LLM(str(path), quantization="none", **TINY)
        assert auto.engine.config.model.quantization == "auto"
        held = auto.engine.model.weight_bytes()
        assert set(held) == {"f32"} and held == none.engine.model.weight_bytes(), path
        ma, mn = auto.engine.model, none.engine.model
        for a, b in ((ma.embed_tokens, mn.embed_tokens), (ma.lm_head, mn.lm_head),
                     (ma.layers[0].attn.wqkv, mn.layers[0].attn.wqkv), (ma.layers[1].mlp.w_down, mn.layers[1].mlp.w_down)):
            assert type(a) is type(b)
            np.testing.assert_array_equal(a.t.numpy(), b.t.numpy())
        batch = [np.random.default_rng(3).integers(0, vocab, 9).tolist()]
        check_greedy(auto, model, batch, rel_tie=0.0)   # fp32: rounding ties only


def test_tied_quantized_head_reads_the_embedding_table(files):
    m = LLM(str(files["mixed"][0]), quantization="auto", **TINY).engine.model
    assert m.lm_head is m.embed_tokens and m.embed_tokens.kind == "q8_0"
    fused = m.layers[0].attn.wqkv                       # q, k in Q4_K and v in Q6_K: kept apart
    assert fused.kind == "q4_k+q6_k" and fused.shape == (256 + 2 * 128, 256)
    assert m.layers[1].attn.wqkv.kind == "q4_k"         # one kind: one row-concatenated weight


def test_auto_under_chunked_prefill_and_prefix_hits(files):
    path, model = files["mixed"]
    llm = LLM(str(path), quantization="auto", kv_cache="prefix", max_num_batched_tokens=8, **TINY)
    shared = prompts(1, (24,))[0]
    check_greedy(llm, model, [shared + [7, 8, 9]])      # chunked: 27 tokens in steps of 8
    check_greedy(llm, model, [shared + [11], shared + [12, 13]])
    assert llm.engine.kv_cache.stats()["prefix_cache_hits"] > 0


def test_none_dequantizes_at_load(files):
    path, model = files["q4_1"]
    llm = LLM(str(path), quantization="none", **TINY)
    assert set(llm.engine.model.weight_bytes()) == {"f32"}
    check_greedy(llm, model, prompts(2, (9,)), rel_tie=0.0)      # fp32: NEAR_TIE, rounding only


def test_a_named_kind_keeps_its_tensors_and_requantizes_the_rest(files):
    path, model = files["q4_1"]
    m = LLM(str(path), quantization="q4_1", **TINY).engine.model
    assert set(m.weight_bytes()) == {"q4_1", "f32"}
    m = LLM(str(path), quantization="q8_0", **TINY).engine.model   # q4_1 -> q8_0 on load
    assert m.layers[0].mlp.w_down.kind == "q8_0" and m.embed_tokens.kind == "q4_1"


# --- wint8 / wint4: an HF checkpoint quantized on load --------------------------------------

def wint_reference(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Symmetric round-to-nearest per row (int8) or per group of columns (int4)."""
    top = 127 if bits == 8 else 7
    g = w.reshape(w.shape[0], -1, group if bits == 4 else w.shape[1])
    scale = np.abs(g).max(-1, keepdims=True) / top
    return (np.clip(np.rint(g / scale), -top, top) * scale).reshape(w.shape)


@pytest.mark.parametrize("kind,tp", [("wint8", 1), ("wint4", 1), ("wint4", 2)])
def test_wint_on_an_hf_checkpoint(tiny_checkpoints, kind, tp):
    """tp 2: o_proj's 64 columns (one group of 64) and down_proj's 128
    (one group of 128) split in two would cut a group: those shards are
    float32 on their ranks, and the tokens stay the reference's."""
    import copy
    path, hf = tiny_checkpoints["LlamaForCausalLM"]
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if any(f".{part}." in name for part in LINEARS):
                w = p.numpy()
                group = 128 if w.shape[1] % 128 == 0 else 64          # the format halves 128 until it divides
                p.copy_(torch.from_numpy(wint_reference(w, 8 if kind == "wint8" else 4, group).astype(np.float32)))
    llm = LLM(str(path), quantization=kind, tensor_parallel_size=tp, max_model_len=128, num_kv_blocks=32,
              block_size=8, progress=False)
    try:
        held = llm.engine.executor.weight_bytes()          # summed over the ranks under TP
        assert set(held) == {kind, "f32"}
        rng = np.random.default_rng(3)
        batch = [rng.integers(3, 49152, n).tolist() for n in (6, 13)]
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
        for p, out in zip(batch, outs):
            got = out.outputs[0].token_ids
            assert got == hf_greedy(ref, p, GREEDY.max_tokens, follow=got, rel_tie=QUANT_TIE)
    finally:
        llm.engine.shutdown()


# --- errors ----------------------------------------------------------------------------------

def test_unknown_quantization_is_a_config_error_naming_the_key(files):
    with pytest.raises(ConfigError, match=r"config key 'model.quantization': no weight_format named 'q3_x'"):
        LLM(str(files["q4_1"][0]), quantization="q3_x", **TINY)


def test_a_kind_with_no_quantizer_is_a_config_error_naming_it(files):
    with pytest.raises(ConfigError, match=r"model.quantization': q4_k: weight 'model.layers.0.self_attn.q_proj."
                                          r"weight' is float32 in the checkpoint .* cannot quantize to q4_k"):
        LLM(str(files["f32"][0]), quantization="q4_k", **TINY)


def test_q8_0_quantizes_a_float_file_on_load(files):
    """An F32 file under q8_0: gguf's quantizer on load, against transformers
    on gguf's Q8_0 round trip of the same weights."""
    import copy
    path, model = files["f32"]
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if any(f".{part}." in name for part in LINEARS):
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), T.Q8_0), T.Q8_0).reshape(p.shape)))
    llm = LLM(str(path), quantization="q8_0", **TINY)
    assert set(llm.engine.model.weight_bytes()) == {"q8_0", "f32"}
    check_greedy(llm, ref, prompts(7, (6, 11)))


def test_bad_format_setting_names_its_key(files):
    path = files["q4_1"][0]
    with pytest.raises(ConfigError, match=r"plugins.weight_format.auto': without_kernel must be keep or fp32"):
        LLM(str(path), quantization="auto", **{"plugins.weight_format.auto": {"without_kernel": "maybe"}}, **TINY)


def test_auto_without_a_kernel_can_hold_fp32(files, caplog, monkeypatch):
    """A kind none of whose kernels the backend's table lists (here q4_0's
    made to go by a name no backend probes)."""
    import logging
    from fdx.ops import quant
    monkeypatch.setitem(quant.KERNELS, "q4_0", (("no-backend-probes-this", quant.reference_matmul),))
    path, model = files["q4_0"]
    with caplog.at_level(logging.INFO, logger="fdx.models.weights"):
        llm = LLM(str(path), quantization="auto", **{"plugins.weight_format.auto": {"without_kernel": "fp32"}},
                  **TINY)
    assert set(llm.engine.model.weight_bytes()) == {"f32"}
    assert "q4_0: no compiled kernel in this backend's table: its tensors are dequantized" in caplog.text
    check_greedy(llm, model, prompts(4, (7,)))


# --- tensor parallel -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", ["q4_1", "mixed"])
def test_tensor_parallel_2_on_quantized_files(files, name):
    """Column-parallel weights split by rows of raw bytes (fused q/k/v and
    gate/up, mixed kinds included); row-parallel ones by whole blocks
    (down_proj: Q6_K, 512 columns in two), and where a split would cut a
    block (layer 1's o_proj: Q4_K, 256 columns in two) that rank holds
    its part in float32."""
    path, model = files[name]
    llm = LLM(str(path), quantization="auto", tensor_parallel_size=2, **TINY)
    try:
        check_greedy(llm, model, prompts(5))
    finally:
        llm.engine.shutdown()


def test_a_row_parallel_split_that_cuts_blocks_holds_that_shard_in_fp32(files, caplog):
    """Q4_K's 256-element blocks do not split 256 columns in two: that
    rank's part is dequantized (logged); the product is the same."""
    import logging

    import paddle
    from fdx.model_io.model import load_model
    from fdx.core.config import FdxConfig
    from fdx.core.plugins import get_plugin_manager
    path, model = files["mixed"]
    config = FdxConfig.build(model=str(path), quantization="auto")
    whole, _ = load_model(config, get_plugin_manager(), progress=False)
    part, _ = load_model(config, get_plugin_manager(), progress=False)
    w = whole.layers[0].mlp.w_down                                # Q6_K [256, 512]
    with caplog.at_level(logging.INFO, logger="fdx.models.weights"):
        left = part.weight_format.shard_cols("down", w, 0, 128)   # half a block
        right = part.weight_format.shard_cols("down", w, 256, 512)  # a whole block
    assert left.kind == "f32" and right.kind == "q6_k"
    assert "does not split at [0, 128)" in caplog.text
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32))
    ref = x.numpy() @ w.dequantize().T
    got = left.matmul(x[:, :128]).numpy() + part.weight_format.shard_cols("d", w, 128, 256).matmul(
        x[:, 128:256]).numpy() + right.matmul(x[:, 256:]).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-4)


# --- the embedded model ------------------------------------------------------------------------

@pytest.mark.slow
def test_default_model_loads_with_auto_near_its_file_size():
    """SmolLM2 Q4_1 (token_embd in Q8_0, tied): the weights held are the
    file's blocks, not 537 MB of float32."""
    import os

    from fdx.model_io.loader import default_model_path
    from fdx.model_io.model import load_model
    from fdx.core.config import FdxConfig
    from fdx.core.plugins import get_plugin_manager
    model, _ = load_model(FdxConfig.build(quantization="auto"), get_plugin_manager(), progress=False)
    held, size = model.weight_bytes(), os.path.getsize(default_model_path())
    assert set(held) == {"q4_1", "q8_0", "f32"}
    assert 0.95 * size < sum(held.values()) <= size
    assert model.lm_head is model.embed_tokens


# --- an outside weight format (tests/plugin_pkg), written from docs/plugins.md ---------------

def per_tensor_int8(model) -> None:
    """Every 2-D weight of ``model`` replaced by its per-tensor int8
    round trip (scale = max|W| / 127), in place: the outside format's
    reference."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                w = p.numpy()
                scale = np.float32(np.abs(w).max() / 127)
                p.copy_(torch.from_numpy(np.clip(np.rint(w / scale), -127, 127).astype(np.float32) * scale))


def test_outside_per_tensor_int8_format_end_to_end(files, example_plugin_installed):
    import copy

    from fdx.core.plugins import PluginManager
    path, model = files["q8_0"]                         # its blocks arrive dequantized (keeps_blocks False)
    ref = copy.deepcopy(model)
    per_tensor_int8(ref)
    llm = LLM(str(path), quantization="example-int8", plugins=PluginManager(), **TINY)
    assert set(llm.engine.model.weight_bytes()) == {"example-int8", "f32"}
    check_greedy(llm, ref, prompts(6))


# --- memory reports --------------------------------------------------------------------------

def test_bench_throughput_reports_the_weights_held(files):
    from fdx.entrypoints.bench.throughput import format_throughput, throughput
    llm = LLM(str(files["mixed"][0]), quantization="auto", **TINY)
    r = throughput(llm, num_requests=2, input_len=4, output_len=2)
    held = llm.engine.model.weight_bytes()
    assert r["weight_bytes"] == held and r["quantization"] == "auto" and r["resident_bytes"] > 0
    # bytes by the types' block sizes (Q4_K 144 per 256, Q6_K 210 per 256, Q8_0 34 / Q4_0 18 / Q4_1 20 per 32)
    assert held["q4_k"] == (256 + 128 + 256 + 128 + 128 + 256) * 144     # q, k (layer 0); q, k, v, o (layer 1)
    assert held["q6_k"] == 128 * 210 + 2 * 256 * 2 * 210                 # v (layer 0), down_proj x 2
    assert held["q8_0"] == (VOCAB + 256) * 256 // 32 * 34                 # the tied embedding, o_proj (layer 0)
    assert held["q4_0"] == 3 * 512 * 256 // 32 * 18 and held["q4_1"] == 512 * 256 // 32 * 20
    assert "weights          " in format_throughput(r) and "q4_k" in format_throughput(r)


def test_engine_stats_report_the_weights_held():
    from types import SimpleNamespace

    from fdx.core.messages import EngineReady
    from fdx.entrypoints.serving.ui import EngineView
    ready = EngineReady(128, 256, 8, 16, "m.gguf", "cpu", weight_bytes={"q4_1": 66, "f32": 1}, resident_bytes=900)
    server = SimpleNamespace(engine=SimpleNamespace(ready=ready), model_name="m", max_model_len=128)
    weights = EngineView().snapshot(server)["weights"]
    assert weights == {"bytes": 67, "by_kind": {"q4_1": 66, "f32": 1}, "engine_resident_bytes_at_ready": 900}


def test_q4_k_on_a_mixed_file_keeps_the_other_block_types(files):
    path, model = files["mixed"]
    m = LLM(str(path), quantization="q4_k", **TINY).engine.model
    assert m.layers[0].mlp.w_down.kind == "q6_k" and m.layers[1].attn.wqkv.kind == "q4_k"
    assert m.layers[0].attn.wo.kind == "q8_0"


# (the default model at TP 3 with quantization auto against transformers: test_tensor_parallel.py,
# on the TP 3 engine its regex test builds)


@pytest.mark.slow
def test_fdx_serve_reports_the_weights_held_in_engine_stats(files, tmp_path):
    import httpx

    from serve_utils import API_KEY, ServerProcess
    path, _ = files["mixed"]
    server = ServerProcess(tmp_path, model={"model": str(path), "quantization": "auto", "max_model_len": 128})
    try:
        server.wait_ready()
        stats = httpx.get(server.base_url + "/v1/engine/stats", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=30).json()
    finally:
        server.stop()
    weights = LLM(str(path), quantization="auto", **TINY).engine.model.weight_bytes()
    assert stats["weights"]["by_kind"] == weights and stats["weights"]["bytes"] == sum(weights.values())
    assert stats["weights"]["engine_resident_bytes_at_ready"] > sum(weights.values())
