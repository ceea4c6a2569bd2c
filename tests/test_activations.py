"""Per-request activation hooks (SamplingParams.activations, docs/research.md)
and the batch layout the forward reads them from (BatchLayout).

The reference is transformers on the same float32 checkpoint: its
``hidden_states`` and torch forward hooks on the attention and MLP modules
for captures, a forward hook adding the same vector for steering. The rows
of the other requests of a batch are compared, bit for bit, with the same
batch run without any hook; with the compiled layers on (a Q8_0 GGUF) too,
where the layers around the hooked one must still run compiled (the op
counters of test_decoder_layer's Spy).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from fdx import LLM, SamplingParams
from fdx.core.hookspecs import hookimpl
from fdx.core.plugins import PluginManager
from tiny_models import TinyLlama

HIDDEN, LAYERS = 32, 4
TINY = TinyLlama(vocab=64, hidden=HIDDEN, intermediate=64, layers=LAYERS, heads=4, kv_heads=2, max_len=128, seed=3,
                 scale=0.3)
ENGINE = dict(max_model_len=128, num_kv_blocks=96, block_size=4, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder, the transformers model on it)."""
    path = TINY.hf_dir(tmp_path_factory.mktemp("acts") / "llama")
    return path, transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class LogitsTap:
    """Each request's raw logits, one row per sampled token (decoding.capture_logits)."""

    def __init__(self):
        self.rows: dict[str, list[np.ndarray]] = {}

    @hookimpl
    def fdx_step_finished(self, context):
        for i, rid in enumerate(context.sampled_request_ids):
            self.rows.setdefault(rid, []).append(np.array(context.logits[i]))


def tapped_llm(path, **kw):
    tap = LogitsTap()
    pm = PluginManager()
    pm.add_plugin(tap, name="logits-tap")
    return LLM(str(path), plugins=pm, capture_logits=True, **{**ENGINE, **kw}), tap


def batch(n: int = 8, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 64, size=int(k)).tolist()} for k in rng.integers(3, 14, size=n)]


def params(acts=None, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, activations=acts)


def run(llm, tap, prompts, plist):
    outs = llm.generate(prompts, plist)
    return outs, [np.stack(tap.rows[o.request_id]) for o in outs]


def adding(vec: np.ndarray):
    """A torch forward hook adding ``vec`` to a module's output (a tensor, or a tuple's first)."""
    v = torch.from_numpy(vec)

    def hook(m, i, o):
        return (o[0] + v,) + tuple(o[1:]) if isinstance(o, tuple) else o + v
    return hook


def hf_forward(model, ids, adds=(), grab=()):
    """transformers over ``ids`` with forward hooks: ``adds`` (point, layer,
    vector) added to every position, ``grab`` (point, layer) module outputs
    kept. Returns (output with hidden_states, {(point, layer): [T, hidden]})."""
    got, handles = {}, []

    def module(point, layer):
        lyr = model.model.layers[layer]
        return {"residual": lyr, "attn_out": lyr.self_attn, "mlp_out": lyr.mlp}[point]

    def grabber(key):
        def hook(m, i, o):
            got[key] = (o[0] if isinstance(o, tuple) else o)[0].detach().numpy().copy()
        return hook
    for point, layer, vec in adds:
        handles.append(module(point, layer).register_forward_hook(adding(vec)))
    for point, layer in grab:
        handles.append(module(point, layer).register_forward_hook(grabber((point, layer))))
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    return out, got


# --- the layout -------------------------------------------------------------------------

def test_the_forward_sees_this_steps_layout(tiny, monkeypatch):
    """Every forward gets the BatchLayout of the step that is running: its
    rows, positions and sampling rows agree with the step's schedule as the
    engine records it after the step (never the previous one's)."""
    from fdx.plugins.models.decoder import DecoderForCausalLM
    seen = []
    real = DecoderForCausalLM.forward

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices):
        seen.append((meta.layout, positions.numpy().tolist(), logits_indices.numpy().tolist()))
        return real(self, input_ids, positions, kv_caches, meta, logits_indices)
    monkeypatch.setattr(DecoderForCausalLM, "forward", forward)
    llm = LLM(str(tiny[0]), max_num_batched_tokens=8, max_num_seqs=3, **ENGINE)
    eng = llm.engine
    steer = {"add": [{"point": "residual", "layer": 0, "vector": [0.0] * HIDDEN}]}
    for i, p in enumerate(batch(4)):
        eng.add_request(eng.make_request(p["prompt_token_ids"], params(steer if i == 1 else None, 3)))
    steps = 0
    while eng.has_unfinished():
        before = {r.request_id: r.num_computed_tokens for r in eng.resource_manager.requests()}
        eng.step()
        sched = eng.last_schedule
        if sched.is_empty:
            continue
        steps += 1
        layout, positions, sample = seen[-1]
        assert layout.request_ids == tuple(sched.num_scheduled_tokens)
        assert layout.num_rows == tuple(sched.num_scheduled_tokens.values())
        assert layout.row_starts == tuple(np.cumsum((0,) + layout.num_rows[:-1]).tolist())
        assert layout.start_positions == tuple(before[rid] for rid in layout.request_ids)
        assert positions == [p0 + j for p0, n in zip(layout.start_positions, layout.num_rows) for j in range(n)]
        assert list(layout.sample_rows) == sample
        for rid, args in zip(layout.request_ids, layout.model_args):
            assert (args is not None) == (rid == "req-1")
    assert steps == len(seen) and steps > 3


# --- captures against transformers -----------------------------------------------------

def test_captures_equal_transformers_at_prompt_and_generated_positions(tiny):
    """residual after layers 1 and 3, attn_out of layer 2, mlp_out of layer 0,
    captured in chunks of 5 tokens a step beside other requests: equal to
    transformers' hidden_states[k + 1] and module outputs over the prompt and
    the generated tokens (the last sampled one never runs a forward)."""
    path, hf = tiny
    llm = LLM(str(path), max_num_batched_tokens=5, max_num_seqs=3, **ENGINE)
    prompts = batch(3, seed=1)
    acts = {"capture": [{"point": "residual", "layer": 1}, {"point": "residual", "layer": 3},
                        {"point": "attn_out", "layer": 2}, {"point": "mlp_out", "layer": 0},
                        {"point": "mlp_out", "layer": 2, "positions": [2, 9]}]}
    outs = llm.generate(prompts, [params(), params(acts), params()])
    assert outs[0].outputs[0].activations is None
    out = outs[1].outputs[0]
    ids = prompts[1]["prompt_token_ids"] + out.token_ids[:-1]
    ref, mods = hf_forward(hf, ids, grab=[("residual", 3), ("attn_out", 2), ("mlp_out", 0), ("mlp_out", 2)])
    caps = out.activations
    assert sorted(caps) == ["attn_out.2", "mlp_out.0", "mlp_out.2", "residual.1", "residual.3"]
    assert caps["residual.1"].positions == list(range(len(ids)))
    assert caps["mlp_out.2"].positions == list(range(2, 9))
    for key, want in (("residual.1", ref.hidden_states[2][0].numpy()), ("residual.3", mods[("residual", 3)]),
                      ("attn_out.2", mods[("attn_out", 2)]), ("mlp_out.0", mods[("mlp_out", 0)]),
                      ("mlp_out.2", mods[("mlp_out", 2)][2:9])):
        assert caps[key].values.shape == want.shape, key
        assert np.abs(caps[key].values - want).max() < 1e-4, key


# --- steering against transformers, and the others' bits -----------------------------

@pytest.mark.parametrize("point, layer", [("residual", 1), ("attn_out", 2), ("mlp_out", 0)])
def test_a_steering_vector_equals_a_transformers_hook_and_leaves_the_batch_alone(tiny, point, layer):
    """One request of eight adds a vector at (point, layer): its logits equal
    transformers with a forward hook adding the same vector (under 1e-4);
    the seven others' logits are bitwise those of the batch run without hooks."""
    path, hf = tiny
    vec = np.random.default_rng(7).standard_normal(HIDDEN).astype(np.float32)
    llm, tap = tapped_llm(path)
    prompts = batch(8)
    _, plain = run(llm, tap, prompts, [params()] * 8)
    steer = {"add": [{"point": point, "layer": layer, "vector": vec.tolist(), "scale": 2.0}]}
    outs, logits = run(llm, tap, prompts, [params()] * 3 + [params(steer)] + [params()] * 4)
    for i in range(8):
        if i != 3:
            assert np.array_equal(logits[i], plain[i]), i
    assert not np.array_equal(logits[3], plain[3])
    p = prompts[3]["prompt_token_ids"]
    ids = p + outs[3].outputs[0].token_ids[:-1]
    ref, _ = hf_forward(hf, ids, adds=[(point, layer, 2.0 * vec)])
    want = ref.logits[0, len(p) - 1:].numpy()
    assert np.abs(logits[3] - want).max() < 1e-4


def test_a_registered_function_steers_only_its_request(tiny, monkeypatch):
    """An add by a registered activation function (fdx_register_activation_functions)
    gets (layer, positions, hidden rows, args) of its request only; its result
    equals transformers with the same function in a forward hook."""
    path, hf = tiny
    calls = []

    def flip(layer, positions, hidden, args):
        calls.append((layer, list(positions), tuple(hidden.shape)))
        return hidden * args["factor"]

    class Functions:
        @hookimpl
        def fdx_register_activation_functions(self, register):
            register("test-scale", flip)
    import fdx.core.plugins as plugins_module
    pm = PluginManager()
    pm.add_plugin(Functions(), name="test-functions")
    monkeypatch.setattr(plugins_module, "_default", pm)     # what the runner looks functions up in
    llm = LLM(str(path), plugins=pm, **ENGINE)
    prompts = batch(3, seed=4)
    acts = {"add": [{"point": "mlp_out", "layer": 1, "function": "test-scale", "args": {"factor": -1.5}}]}
    plain = llm.generate(prompts, params(max_tokens=4))
    outs = llm.generate(prompts, [params(max_tokens=4), params(acts, 4), params(max_tokens=4)])
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [plain[i].outputs[0].token_ids for i in (0, 2)]
    n = len(prompts[1]["prompt_token_ids"])
    assert calls[0] == (1, list(range(n)), (n, HIDDEN)) and all(c[1] == [n + j] for j, c in enumerate(calls[1:]))
    handle = hf.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * -1.5)
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompts[1]["prompt_token_ids"]]), max_new_tokens=4, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    finally:
        handle.remove()
    assert outs[1].outputs[0].token_ids == want


def test_bad_activation_requests_are_refused_naming_the_field(tiny):
    llm = LLM(str(tiny[0]), **ENGINE)
    for acts, match in [
            ({"capture": [{"point": "logits", "layer": 0}]}, r"activations\.capture\[0\]\.point"),
            ({"capture": [{"point": "residual", "layer": -1}]}, r"activations\.capture\[0\]\.layer"),
            ({"add": [{"point": "residual", "layer": 0}]}, r"activations\.add\[0\]: .*exactly one"),
            ({"add": [{"point": "residual", "layer": 0, "vector": [float("nan")] * HIDDEN}]},
             r"activations\.add\[0\]\.vector"),
            ({"capture": [{"point": "residual", "layer": 0, "positions": [5, 2]}]},
             r"activations\.capture\[0\]\.positions"),
            ({"steer": []}, r"activations\.steer")]:
        with pytest.raises(ValueError, match=match):
            params(acts)
    for acts, match in [({"capture": [{"point": "residual", "layer": LAYERS}]}, r"layer 4 does not exist"),
                        ({"add": [{"point": "residual", "layer": 0, "vector": [1.0] * 3}]}, r"hidden size is 32"),
                        ({"add": [{"point": "residual", "layer": 0, "function": "nope"}]},
                         r"'nope' is not registered")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [3, 4]}], params(acts))
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks


# --- prefix cache, chunking and preemption ---------------------------------------------

def test_prefix_cache_preemption_and_chunks_keep_hooks_exact(tiny):
    """With the prefix cache, a small KV pool (preemptions) and 4-token
    chunks: a captured request takes no prefix hit and its captures have one
    row per position (recomputed positions are not duplicated), equal to
    transformers; a steered request is steered again after preemption (its
    tokens equal transformers with the hook) and its blocks serve no one
    else (a later plain request with the same prompt hits nothing of it and
    equals the plain run)."""
    path, hf = tiny
    vec = np.random.default_rng(9).standard_normal(HIDDEN).astype(np.float32) * 2
    llm = LLM(str(path), kv_cache="prefix", max_num_batched_tokens=4, max_num_seqs=4,
              **{**ENGINE, "max_model_len": 32, "num_kv_blocks": 12})
    prompts = batch(4, seed=5)
    shared = prompts[0]["prompt_token_ids"]
    cap = {"capture": [{"point": "residual", "layer": 2}]}
    steer = {"add": [{"point": "residual", "layer": 1, "vector": vec.tolist()}]}
    warm = llm.generate([{"prompt_token_ids": shared}], params(max_tokens=12))
    outs = llm.generate([{"prompt_token_ids": shared}, prompts[1], prompts[2], prompts[3]],
                        [params(cap, 12), params(steer, 12), params(max_tokens=12), params(max_tokens=12)])
    assert llm.engine.num_recomputed_tokens > 0           # preempted and recomputed
    assert outs[0].num_cached_tokens == 0 and outs[0].outputs[0].token_ids == warm[0].outputs[0].token_ids
    c = outs[0].outputs[0].activations["residual.2"]
    ids = shared + outs[0].outputs[0].token_ids[:-1]
    assert c.positions == list(range(len(ids)))
    ref, _ = hf_forward(hf, ids)
    assert np.abs(c.values - ref.hidden_states[3][0].numpy()).max() < 1e-4
    n = len(prompts[1]["prompt_token_ids"])
    handle = hf.model.layers[1].register_forward_hook(adding(vec))
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompts[1]["prompt_token_ids"]]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, n:].tolist()
    finally:
        handle.remove()
    assert outs[1].outputs[0].token_ids == want
    again = llm.generate([prompts[1]], params(max_tokens=12))[0]
    solo = LLM(str(path), **{**ENGINE, "max_model_len": 32}).generate([prompts[1]], params(max_tokens=12))[0]
    assert again.outputs[0].token_ids == solo.outputs[0].token_ids != want


def test_captures_of_recomputed_positions_are_not_duplicated():
    """The request's store keeps one row per position: a position captured
    again (recomputed after a preemption) replaces its row."""
    from fdx.core.activations import collect, keep
    from fdx.core.interfaces import ActivationCapture
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    store = keep(None, [ActivationCapture("residual", 1, [0, 1, 2], 4, rows.tobytes())])
    store = keep(store, [ActivationCapture("residual", 1, [1, 2], 4, (rows[1:] + 100).tobytes())])
    got = collect(store)["residual.1"]
    assert got.positions == [0, 1, 2]
    np.testing.assert_array_equal(got.values, np.vstack([rows[:1], rows[1:] + 100]))


def test_model_runner_output_with_captures_crosses_msgpack():
    """ModelRunnerOutput.activations is plain data: WorkerResult carries it
    from tensor-parallel rank 0 over msgpack."""
    import msgspec

    from fdx.core.interfaces import ActivationCapture, ModelRunnerOutput
    rows = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    out = ModelRunnerOutput(sampled={"a": 3}, activations={"a": [ActivationCapture("mlp_out", 2, [4, 5], 8,
                                                                                   rows.tobytes())]})
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(out), type=ModelRunnerOutput)
    np.testing.assert_array_equal(back.activations["a"][0].array(), rows)
    sp = params({"add": [{"point": "residual", "layer": 0, "vector": np.ones(4, np.float32)}]})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams) == sp


# --- with the compiled layers ------------------------------------------------------------

@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    """A 4-layer Llama as a Q8_0 GGUF (the compiled whole-layer kernels take it)."""
    from gguf import GGMLQuantizationType as T
    from test_weight_formats import quantized_gguf
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                                   initializer_range=0.05)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return quantized_gguf(tmp_path_factory.mktemp("q8") / "q8.gguf", model, lambda n: T.Q8_0)


@pytest.mark.parametrize("point", ["residual", "attn_out"])
def test_compiled_layers_run_around_the_hooked_one_and_the_batch_keeps_its_bits(q8_file, point, monkeypatch):
    """Q8_0, compiled layers on, 16 tokens a step (prompts in chunks beside
    decodes): one request of eight steered at layer 1.
    The layers before it still run in the one compiled call (decoder_stack
    over layer 0) and the layers after it compiled one by one; the hooked
    layer runs the whole-layer kernel for the other rows (attn_out: beside
    the composed ops for the steered request). The other seven requests'
    logits are bitwise those of the batch without hooks."""
    from fdx.ops import cpp
    if not cpp.available():
        pytest.skip(f"compiled ops unavailable: {cpp.unavailable_reason()}")
    from fdx.plugins.backends.attention import FUSED_LAYERS_ENV
    from test_decoder_layer import Spy
    monkeypatch.setenv(FUSED_LAYERS_ENV, "1")
    spy = Spy(monkeypatch)
    llm, tap = tapped_llm(q8_file, quantization="auto", max_num_seqs=8, max_num_batched_tokens=16)   # chunks
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(0, 256, size=int(k)).tolist()} for k in rng.integers(3, 12, size=8)]
    _, plain = run(llm, tap, prompts, [params()] * 8)
    assert spy.by_name["decoder_stack"] > 0 and spy.by_name["decoder_layer"] == 0, spy.by_name
    steps_before = dict(spy.by_name)
    vec = rng.standard_normal(64).astype(np.float32)
    steer = {"add": [{"point": point, "layer": 1, "vector": vec.tolist(), "scale": 3.0}]}
    _, logits = run(llm, tap, prompts, [params()] * 5 + [params(steer)] + [params()] * 2)
    stack = spy.by_name["decoder_stack"] - steps_before["decoder_stack"]
    layer = spy.by_name["decoder_layer"] - steps_before["decoder_layer"]
    # a step with the steered request's rows: the stack over layer 0, then the kernel for layers 1 (the
    # other rows), 2 and 3; a step without them: the one stack call
    assert stack > 0 and layer > 0 and layer % 3 == 0, spy.by_name
    for i in range(8):
        if i != 5:
            assert np.array_equal(logits[i], plain[i]), i
    assert not np.array_equal(logits[5], plain[5])


# --- an outside model (tests/plugin_pkg), written from the Model contract -----------------

def test_an_outside_model_reads_the_layout_and_runs_the_hooks(tiny, tmp_path, example_plugin_installed):
    """ExampleLlamaForCausalLM (the third-party package, selected by the
    checkpoint's architecture name) sees each step's layout, and runs the
    activation hooks from ``meta.activations``: captures equal transformers,
    a steering vector equals transformers with the hook, and the other
    requests keep their tokens."""
    import json
    import shutil
    path, hf = tiny
    dst = tmp_path / "outside"
    shutil.copytree(path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["ExampleLlamaForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(dst), plugins=PluginManager(), max_num_batched_tokens=6, max_num_seqs=3, **ENGINE)
    model = llm.engine.model
    assert type(model).__name__ == "ExampleLlamaForCausalLM"
    prompts = batch(3, seed=8)
    vec = np.random.default_rng(3).standard_normal(HIDDEN).astype(np.float32)
    acts = {"capture": [{"point": "attn_out", "layer": 1}, {"point": "residual", "layer": 0}],
            "add": [{"point": "residual", "layer": 2, "vector": vec.tolist()}]}
    plain = llm.generate(prompts, params(max_tokens=5))
    model.seen_layouts.clear()
    outs = llm.generate(prompts, [params(max_tokens=5), params(acts, 5), params(max_tokens=5)])
    assert [outs[i].outputs[0].token_ids for i in (0, 2)] == [plain[i].outputs[0].token_ids for i in (0, 2)]
    # the layouts: every row of a step belongs to exactly one request, positions run on from step to step
    done: dict[str, int] = {}
    for layout in model.seen_layouts:
        at = 0
        for rid, (r0, count, p0) in layout.items():
            assert r0 == at and p0 == done.get(rid, 0)
            at, done[rid] = r0 + count, p0 + count
    assert {o.request_id for o in outs} <= set(done)
    out = outs[1].outputs[0]
    p = prompts[1]["prompt_token_ids"]
    ids = p + out.token_ids[:-1]
    ref, mods = hf_forward(hf, ids, adds=[("residual", 2, vec)], grab=[("attn_out", 1)])
    assert np.abs(out.activations["attn_out.1"].values - mods[("attn_out", 1)]).max() < 1e-4
    assert np.abs(out.activations["residual.0"].values - ref.hidden_states[1][0].numpy()).max() < 1e-4
    handle = hf.model.layers[2].register_forward_hook(adding(vec))
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist()
    finally:
        handle.remove()
    assert out.token_ids == want
    # a model class that says it runs no hooks refuses a request that asks, naming the field
    cfg["architectures"] = ["ExampleNoTapForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    notap = LLM(str(dst), plugins=PluginManager(), **ENGINE)
    with pytest.raises(ValueError, match=r"activations.*supports_activation_hooks"):
        notap.generate(prompts[:1], params(acts))


# --- over HTTP ------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_real_server_returns_a_capture_and_bounds_it(tiny, tmp_path):
    """``fdx serve`` on the tiny checkpoint: the request body's
    ``activations`` captures the residual stream after layer 1 at four
    prompt positions, returned in the choice, equal to transformers; a
    capture past the size limit, an open range or a malformed entry is a
    400 naming the field; the server keeps serving, and a streamed response
    carries the capture on the choice's last chunk."""
    import json

    import httpx

    from fdx.core.activations import MAX_HTTP_CAPTURE_POSITIONS
    from serve_utils import API_KEY, ready_server
    path, hf = tiny
    srv = ready_server(tmp_path, {}, model={"model": str(path), "max_model_len": 128},
                       cache={"block_size": 4, "num_kv_blocks": 96})
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        prompt = [5, 9, 23, 41, 7, 30]
        body = {"model": srv_model(srv, headers), "prompt": prompt, "max_tokens": 3, "temperature": 0,
                "activations": {"capture": [{"point": "residual", "layer": 1, "positions": [0, 4]}]}}
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["activations"]["residual.1"]
        assert got["positions"] == [0, 1, 2, 3]
        ref, _ = hf_forward(hf, prompt)
        assert np.abs(np.asarray(got["values"], np.float32) - ref.hidden_states[2][0, :4].numpy()).max() < 1e-4
        for acts, field in [
                ({"capture": [{"point": "residual", "layer": 1, "positions": [0, MAX_HTTP_CAPTURE_POSITIONS + 1]}]},
                 "activations.capture[0].positions"),
                ({"capture": [{"point": "residual", "layer": 1}]}, "activations.capture[0].positions"),
                ({"capture": [{"point": "nowhere", "layer": 1, "positions": [0, 2]}]}, "activations.capture[0].point"),
                ({"capture": [{"point": "residual", "layer": 9, "positions": [0, 2]}]}, "layer 9 does not exist")]:
            r = httpx.post(f"{srv.base_url}/v1/completions", json={**body, "activations": acts}, headers=headers,
                           timeout=60)
            assert r.status_code == 400, (acts, r.text)
            assert field in r.json()["error"]["message"], r.text
        r = httpx.post(f"{srv.base_url}/v1/completions", json={**body, "activations": None}, headers=headers,
                       timeout=60)
        assert r.status_code == 200 and "activations" not in r.json()["choices"][0]
        # streamed: the capture rides the choice's last chunk
        chunks = []
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json={**body, "stream": True}, headers=headers,
                          timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        last = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
        assert len(last) == 1 and last[0]["activations"]["residual.1"]["values"] == got["values"]
    finally:
        srv.stop()


def srv_model(srv, headers) -> str:
    import httpx
    return httpx.get(f"{srv.base_url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]


# --- tensor parallel ---------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_captures_and_steers_as_tp1(tiny):
    """TP 2 (today's TP runner, two worker processes): the hooks run on every
    rank on the full residual, rank 0 sends the captures back inside
    ModelRunnerOutput. Captures equal transformers; the steered request's
    tokens equal TP 1's steered tokens and transformers with the hook; the
    others equal TP 2 without hooks."""
    path, hf = tiny
    vec = np.random.default_rng(11).standard_normal(HIDDEN).astype(np.float32) * 2
    prompts = batch(4, seed=12)
    acts = {"capture": [{"point": "attn_out", "layer": 2}, {"point": "residual", "layer": 1}],
            "add": [{"point": "mlp_out", "layer": 1, "vector": vec.tolist()}]}
    plist = [params(max_tokens=5), params(acts, 5), params(max_tokens=5), params(max_tokens=5)]
    one = LLM(str(path), **ENGINE).generate(prompts, plist)
    with LLM(str(path), tensor_parallel_size=2, **ENGINE) as two:
        plain = two.generate(prompts, params(max_tokens=5))
        got = two.generate(prompts, plist)
    assert [got[i].outputs[0].token_ids for i in (0, 2, 3)] == [plain[i].outputs[0].token_ids for i in (0, 2, 3)]
    out = got[1].outputs[0]
    assert out.token_ids == one[1].outputs[0].token_ids
    p = prompts[1]["prompt_token_ids"]
    ids = p + out.token_ids[:-1]
    ref, mods = hf_forward(hf, ids, adds=[("mlp_out", 1, vec)], grab=[("attn_out", 2)])
    assert out.token_ids == [int(t) for t in ref.logits[0, len(p) - 1:].argmax(-1)]
    assert np.abs(out.activations["attn_out.2"].values - mods[("attn_out", 2)]).max() < 1e-4
    assert np.abs(out.activations["residual.1"].values - ref.hidden_states[2][0].numpy()).max() < 1e-4
