"""The grouped expert kernel (fdx.ops.moe, csrc/moe_kernels.h): a MoE
layer's routed experts in one call, the weights kept in their format.

- the op against a float64 numpy reference per weight format (every GGML
  block kind the dense path multiplies, wint8/wint4, float32), in every
  build the backend's probe passed on this CPU: 8 experts, top-2, hidden 64
  (256 for the k-quants, whose blocks are 256 wide);
- a row's bits do not depend on the rows beside it (backend.batch_invariant
  for the quantized kinds, always for float32);
- through the engine on a tiny random Qwen3-MoE (written here with numpy;
  tests/test_moe.py's writer makes its GGUF): the grouped call runs, its greedy tokens are the per-expert
  loop's (FDX_MOE_GROUPED=0), and under backend.batch_invariant a Q8_0 GGUF
  of it gives each prompt alone the tokens and logprobs it gets batched.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np
import paddle
import pytest

from fdx.core import kernels
from fdx.core.kernels import KernelTable
from fdx.ops import moe
from fdx.ops.probes import MOE_PROBE_KINDS, moe_reference, random_stack
from test_contracts import cpu_kernel_table

E, K = 8, 2


@pytest.fixture(scope="module")
def table() -> KernelTable:
    t = cpu_kernel_table()
    assert t.usable("cpp.moe_experts"), t.why_not("cpp.moe_experts")      # the portable build runs everywhere
    return t


def _case(kind: str, rows: int, seed: int):
    rng = np.random.default_rng(seed)
    h = 256 if kind.endswith("_k") else 64
    inter = 256 if kind.endswith("_k") else 64          # wint4: groups of 64
    gu, dn = random_stack(kind, E, 2 * inter, h, rng), random_stack(kind, E, h, inter, rng)
    x = rng.standard_normal((rows, h)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(rows)]).astype(np.int64)
    ids[0] = [3, 3 - 1]                      # expert 3 and 2 in slot order 0, 1 (not sorted by id)
    w = rng.random((rows, K)).astype(np.float32)
    return x, ids, w, gu, dn


@pytest.mark.parametrize("kind", MOE_PROBE_KINDS)
def test_grouped_op_equals_float64_reference(table, kind):
    x, ids, w, gu, dn = _case(kind, 9, 1)
    want = moe_reference(x, ids, w, gu, dn)
    builds = [v for v in ("portable", "avx2", "avx512") if table.usable(moe.moe_kernel_name(v))]
    for variant in builds:
        with kernels.using(table):
            got = moe.experts(paddle.to_tensor(x), ids, w, gu, dn, variant).numpy()
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, f"{kind} {variant}: max relative error {err:.3g}"
    # against the unrounded activations too: only the format's own int8 rounding of x apart
    plain = moe_reference(x, ids, w, gu, dn, as_kernels=False)
    assert np.abs(got - plain).max() < (1e-5 if kind == "f32" else 3e-2) * np.abs(plain).max()


def test_mixed_kinds_as_a_q4_k_m_file_holds_them(table):
    """gate+up in Q4_K and down in Q6_K (llama-quantize's Q4_K_M), float32 activations between."""
    rng = np.random.default_rng(4)
    gu, dn = random_stack("q4_k", E, 512, 256, rng), random_stack("q6_k", E, 256, 256, rng)
    x = rng.standard_normal((6, 256)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(6)]).astype(np.int64)
    w = rng.random((6, K)).astype(np.float32)
    with kernels.using(table):
        got = moe.experts(paddle.to_tensor(x), ids, w, gu, dn)
    assert got is not None                                  # the widest build this CPU passed took it
    want = moe_reference(x, ids, w, gu, dn)
    assert np.abs(got.numpy() - want).max() < 1e-5 * np.abs(want).max()


def test_wrong_expert_id_is_named(table):
    x, ids, w, gu, dn = _case("q8_0", 2, 2)
    ids[1, 0] = E
    with kernels.using(table), pytest.raises(Exception, match="expert id 8 out of range"):
        moe.experts(paddle.to_tensor(x), ids, w, gu, dn, "portable")


@pytest.mark.parametrize("kind", ["f32", "q8_0", "q4_k", "wint4"])
def test_a_row_alone_equals_it_batched(table, kind):
    """Bitwise: 13 rows (past q8_0's 12-row VNNI tiles, which batch_invariant turns off) in one
    call, and each row alone, in every build that passed."""
    x, ids, w, gu, dn = _case(kind, 13, 3)
    inv = KernelTable(dict(table.findings), "test", batch_invariant=True)
    for variant in [v for v in ("portable", "avx2", "avx512") if table.usable(moe.moe_kernel_name(v))]:
        with kernels.using(inv):
            batched = moe.experts(paddle.to_tensor(x), ids, w, gu, dn, variant).numpy()
            for r in range(x.shape[0]):
                alone = moe.experts(paddle.to_tensor(x[r:r + 1]), ids[r:r + 1], w[r:r + 1], gu, dn, variant).numpy()
                assert np.array_equal(alone[0], batched[r]), f"{kind} {variant}: row {r}"


# --- through the engine ------------------------------------------------------------------------

VOCAB = 300


def write_qwen3_moe(root: Path, seed: int = 0, kv: int = 2, name: str = "qwen3moe") -> Path:
    """A tiny random Qwen3-MoE folder (hidden 64, 4 heads, ``kv`` KV heads, 8
    experts, top-2, layer 1 dense) in numpy."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    rng = np.random.default_rng(seed)
    h, heads, hd, inter, moe_inter, layers = 64, 4, 16, 96, 32, 3
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=h,
               intermediate_size=inter, moe_intermediate_size=moe_inter, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, max_position_embeddings=256,
               num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, mlp_only_layers=[1],
               decoder_sparse_step=1, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1, torch_dtype="float32", hidden_act="silu")
    r = lambda *s: (0.2 * rng.standard_normal(s)).astype(np.float32)            # noqa: E731
    norm = lambda n: (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)      # noqa: E731
    w = {"model.embed_tokens.weight": r(VOCAB, h), "model.norm.weight": norm(h), "lm_head.weight": r(VOCAB, h)}
    for i in range(layers):
        p = f"model.layers.{i}"
        w.update({f"{p}.input_layernorm.weight": norm(h), f"{p}.post_attention_layernorm.weight": norm(h),
                  f"{p}.self_attn.q_proj.weight": r(heads * hd, h), f"{p}.self_attn.k_proj.weight": r(kv * hd, h),
                  f"{p}.self_attn.v_proj.weight": r(kv * hd, h), f"{p}.self_attn.o_proj.weight": r(h, heads * hd),
                  f"{p}.self_attn.q_norm.weight": norm(hd), f"{p}.self_attn.k_norm.weight": norm(hd)})
        if i == 1:
            w.update({f"{p}.mlp.gate_proj.weight": r(inter, h), f"{p}.mlp.up_proj.weight": r(inter, h),
                      f"{p}.mlp.down_proj.weight": r(h, inter)})
            continue
        w[f"{p}.mlp.gate.weight"] = r(E, h)
        for e in range(E):
            q = f"{p}.mlp.experts.{e}"
            w.update({f"{q}.gate_proj.weight": r(moe_inter, h), f"{q}.up_proj.weight": r(moe_inter, h),
                      f"{q}.down_proj.weight": r(h, moe_inter)})
    path = root / name
    path.mkdir()
    save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(the folder, its Q8_0 GGUF as llama.cpp's converter writes it: experts stacked in 3-D tensors)."""
    from test_moe import Case, write_gguf
    root = tmp_path_factory.mktemp("moe_grouped")
    folder = write_qwen3_moe(root)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}     # what write_gguf reads
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, write_gguf(Case("qwen3moe", "Qwen3MoeForCausalLM", None, folder), root / "q8_0.gguf", "Q8_0")


PROMPTS = [np.random.default_rng(s).integers(3, VOCAB, n).tolist() for s, n in ((1, 9), (2, 3), (3, 14), (4, 6))]


def _generate(source: Path, prompts: list, **kw) -> tuple[list, list]:
    from fdx import LLM, SamplingParams
    args = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=40, block_size=4,
                progress=False)
    args.update(kw)
    llm = LLM(str(source), **args)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3))
        blocks = llm.engine.model.moe_blocks
        grouped = [b._stacks not in (None, False) for b in blocks]
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs)) for o in outs], grouped
    finally:
        llm.close()
        del llm
        gc.collect()


def test_engine_grouped_equals_the_expert_loop(checkpoints, monkeypatch):
    folder, _ = checkpoints
    got, grouped = _generate(folder, PROMPTS, quantization="none")
    assert grouped and all(grouped)                                      # the one-call path ran
    monkeypatch.setenv("FDX_MOE_GROUPED", "0")
    loop, grouped = _generate(folder, PROMPTS, quantization="none")
    assert not any(grouped)
    assert [t for t, _ in got] == [t for t, _ in loop]


def test_engine_q8_0_solo_equals_batched_bitwise(checkpoints):
    _, q8 = checkpoints
    batched, grouped = _generate(q8, PROMPTS, batch_invariant=True)
    assert all(grouped)
    for p, want in zip(PROMPTS, batched):
        assert _generate(q8, [p], batch_invariant=True)[0] == [want]


def test_engine_expert_load_is_the_routers_choice(checkpoints):
    """Issue 39 item 5 through the engine: an observer of ``fdx_step_finished``
    sees each step's ``expert_load``, which equals a count of what the router
    (replaced by ``set_router``, the hook point a plugin's ``model.moe_router``
    fills) chose in each MoE layer during that step."""
    from fdx import LLM, SamplingParams
    from fdx.core.hookspecs import hookimpl
    from fdx.plugins.models.moe_layers import softmax_topk_router

    folder, _ = checkpoints
    chosen: list[np.ndarray] = []
    top2 = softmax_topk_router(K, True)

    def recording(logits, bias):
        ids, weights = top2(logits, bias)
        chosen.append(ids)
        return ids, weights

    class Observer:
        def __init__(self):
            self.steps = []

        @hookimpl
        def fdx_step_finished(self, scheduler_output, step_stats):
            self.steps.append((step_stats.num_scheduled_tokens, step_stats.expert_load, list(chosen)))
            chosen.clear()

    llm = LLM(str(folder), max_model_len=64, max_num_seqs=4, max_num_batched_tokens=8, num_kv_blocks=40,
              block_size=4, quantization="none", progress=False)
    obs = Observer()
    try:
        llm.engine.model.set_router(recording)
        llm.engine.plugins.pm.register(obs)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        llm.engine.plugins.pm.unregister(obs)
        llm.close()
    ran = [s for s in obs.steps if s[0]]
    assert len(ran) > 4 and any(s[0] == 8 for s in ran)          # chunked prefill and decode steps
    for tokens, load, calls in ran:
        assert len(calls) == 2 == len(load)                         # layers 0 and 2 route, layer 1 is dense
        assert load == [np.bincount(c.reshape(-1), minlength=E).tolist() for c in calls]
        assert all(sum(layer) == tokens * K for layer in load)
