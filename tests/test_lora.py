"""LoRA adapters per request (docs/lora.md, core/lora.py).

The reference is transformers + peft on the same float32 checkpoint and the
same adapter files (written here by peft with random A and B): fdx's logits
equal peft's within 1e-4, for two adapters and the base model mixed in one
batch, and each request's logits in the batch equal its run alone, bit for
bit, and in the batch reversed (with backend.batch_invariant; float32, wint4
and the default model's Q4_1 base). A quantized base (wint8/4, q8_0) keeps
its base-model rows bitwise equal to an engine without LoRA; TP 2 gives the
same greedy tokens; bad adapters are refused at load with the reason.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from fdx import LLM, LoRARequest, SamplingParams
from fdx.core.plugins import PluginManager
from test_activations import LogitsTap, tapped_llm
from tiny_models import TinyLlama

TINY = TinyLlama(vocab=64, hidden=32, intermediate=64, layers=2, heads=4, kv_heads=2, max_len=128, seed=5,
                 scale=0.3)
ENGINE = dict(max_model_len=128, num_kv_blocks=64, block_size=4, progress=False)
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)
PROMPTS = [[3, 9, 14, 7, 22, 5], [11, 4, 30, 2, 17], [8, 8, 40, 13, 6, 21, 9]]


def write_adapter(base: transformers.PreTrainedModel, path, seed: int, r: int = 4, alpha: int = 8,
                  targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                  **extra) -> str:
    """A PEFT adapter with random A and B (peft's own files), saved at ``path``."""
    import peft
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                          lora_dropout=0.0, **extra)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)                 # a delta the logits show clearly
    model.save_pretrained(str(path))
    base = model.unload()                   # peft edits the base model's modules in place: undo
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF folder, adapter "a" path, adapter "b" path)."""
    root = tmp_path_factory.mktemp("lora")
    path = TINY.hf_dir(root / "llama")
    base = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    a = write_adapter(base, root / "a", seed=1)
    b = write_adapter(base, root / "b", seed=2, r=8, alpha=4, targets=("q_proj", "v_proj", "down_proj"),
                      use_rslora=True)
    return path, a, b


def peft_logits(path, adapter: str | None, ids: list[int]) -> np.ndarray:
    """transformers (+ peft's PeftModel when ``adapter``) logits at every position."""
    import peft
    model = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def tapped(path, **kw):
    """An engine whose tap keeps each request's raw logits (test_activations')."""
    return tapped_llm(path, **{**ENGINE, **kw})


def greedy(n: int = 4) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(llm, tap, prompts, loras, n: int = 4):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), lora_request=loras)
    return [o.outputs[0].token_ids for o in outs], [np.stack(tap.rows[o.request_id]) for o in outs]


def assert_batch_invariant(llm, tap, prompts, loras, tokens=None, logits=None):
    """Each request's tokens and logits (every step's row) in the batch, in
    the batch reversed, and alone: bit for bit the same."""
    if tokens is None:
        tokens, logits = run(llm, tap, prompts, loras)
    rev_tokens, rev = run(llm, tap, prompts[::-1], loras[::-1])
    for i, (lr, toks, got) in enumerate(zip(loras, tokens, logits)):
        solo_tokens, solo = run(llm, tap, [prompts[i]], [lr])
        name = None if lr is None else lr.lora_name
        assert rev_tokens[::-1][i] == toks == solo_tokens[0], (i, name)
        assert np.array_equal(rev[::-1][i], got), (i, name, np.abs(rev[::-1][i] - got).max())
        assert np.array_equal(solo[0], got), (i, name, np.abs(solo[0] - got).max())
    return tokens, logits


#: Two adapters (a twice: one adapter group of two row spans) and the base model, and a prompt
#: long enough that the step's rows reach the compiled product's register tiles.
MIXED = PROMPTS + [list(range(2, 50))]


def test_mixed_batch_equals_peft_and_each_solo_run(tiny):
    """Adapter a, the base model and adapter b in one batch: each request's
    logits at its prompt's end and at every generated token equal
    transformers + peft over the same tokens (max abs diff < 1e-4), and
    with backend.batch_invariant equal, bit for bit, its own run alone and
    in the batch reversed (the adapter's shrink and expand are the compiled
    row-fixed product: fdx.ops.dense.lora_matmul)."""
    path, a, b = tiny
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    llm, tap = tapped(path, batch_invariant=True, **LORA)
    loras = [ra, None, rb, ra]
    tokens, logits = run(llm, tap, MIXED, loras)
    for prompt, lr, toks, got in zip(MIXED, loras, tokens, logits):
        ids = prompt + toks
        want = peft_logits(path, None if lr is None else lr.lora_path, ids)[len(prompt) - 1:len(ids) - 1]
        assert np.abs(got - want).max() < 1e-4, (lr, np.abs(got - want).max())
    base = peft_logits(path, None, MIXED[0] + tokens[0])[len(MIXED[0]) - 1]
    assert np.abs(logits[0][0] - base).max() > 1e-2        # the adapter changes the logits
    assert_batch_invariant(llm, tap, MIXED, loras, tokens, logits)


def test_quantized_base_solo_and_batched_bitwise(tiny):
    """The same on wint4 base weights (the adapter float32 beside the
    quantized product)."""
    path, a, b = tiny
    llm, tap = tapped(path, batch_invariant=True, quantization="wint4", **LORA)
    assert_batch_invariant(llm, tap, MIXED, [LoRARequest("a", 1, a), None, LoRARequest("b", 2, b),
                                             LoRARequest("a", 1, a)])


def write_random_adapter(path, shapes: dict[str, tuple[int, int]], layers: int, seed: int, r: int,
                         targets: tuple[str, ...]) -> str:
    """A PEFT folder (peft's key names and config keys) with random A and B, for a
    model too big to wrap in peft here (the default model)."""
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(layers):
        for m in targets:
            out, inp = shapes[m]
            part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{part}.{m}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((r, inp)) * 0.05).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, r)) * 0.05).astype(np.float32)
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets)}))
    return str(path)


@pytest.mark.slow
def test_default_model_quantized_solo_and_batched_bitwise(tmp_path):
    """The embedded default model in its checkpoint's Q4_1 with
    backend.batch_invariant: two random adapters and the base model in one
    batch; each request's tokens and top logprobs equal its run alone and in
    the batch reversed, and an adapter changes its request's output."""
    llm = LLM(batch_invariant=True, enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=256,
              num_kv_blocks=64, block_size=16, progress=False)
    model = llm.engine.executor.model
    shapes, layers = model.lora_shapes(), model.num_layers
    a = LoRARequest("a", 1, write_random_adapter(tmp_path / "a", shapes, layers, 1, 4,
                                                 ("q_proj", "v_proj", "o_proj", "down_proj")))
    b = LoRARequest("b", 2, write_random_adapter(tmp_path / "b", shapes, layers, 2, 8,
                                                 ("k_proj", "gate_proj", "up_proj")))
    prompts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,", "Name a color:"]
    loras = [a, None, b, a]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)

    def go(ps, ls):
        return [(o.outputs[0].token_ids, repr(o.outputs[0].logprobs))
                for o in llm.generate(ps, params, lora_request=ls)]
    together = go(prompts, loras)
    assert go(prompts[::-1], loras[::-1])[::-1] == together
    assert [go([p], [lr])[0] for p, lr in zip(prompts, loras)] == together
    assert go([prompts[0]], [None])[0][1] != together[0][1]        # the adapter changes the output


def test_lora_product_rows_do_not_depend_on_the_others():
    """fdx.ops.dense.lora_matmul, the LoRA shrink and expand, under
    backend.batch_invariant: in the cpu backend's table (the compiled
    product) and in the reference table (1-row products), each row of a
    100-row product is bitwise the row computed alone and within float32
    rounding of numpy's float64 product, at the shapes a shrink ([in, r])
    and an expand ([r, out]) have."""
    import dataclasses

    import paddle

    from fdx.core import kernels
    from fdx.ops import cpp
    from fdx.ops.dense import lora_matmul
    from test_contracts import cpu_kernel_table
    rng = np.random.default_rng(3)
    tables = [kernels.REFERENCE] + ([cpu_kernel_table()] if cpp.available() else [])
    for table in tables:
        for k, n in ((576, 4), (24, 1536), (32, 96)):
            x = rng.standard_normal((100, k)).astype(np.float32)
            w = rng.standard_normal((k, n)).astype(np.float32)
            with kernels.using(dataclasses.replace(table, batch_invariant=True)):
                whole = lora_matmul(paddle.to_tensor(x), paddle.to_tensor(w)).numpy()
                for rows in ((3, 4), (0, 13), (40, 90)):
                    part = lora_matmul(paddle.to_tensor(x[rows[0]:rows[1]]), paddle.to_tensor(w)).numpy()
                    assert np.array_equal(part, whole[rows[0]:rows[1]]), (table.source, k, n, rows)
            want = x.astype(np.float64) @ w.astype(np.float64)
            assert np.abs(whole - want).max() < 1e-5 * np.abs(want).max(), (table.source, k, n)


@pytest.mark.parametrize("quantization", ["wint8", "wint4", "q8_0"])
def test_quantized_base_keeps_base_rows_bitwise(tiny, quantization):
    """Quantized base weights (wint8/4; q8_0: GGUF blocks) with adapter a
    beside a base request: the base request's logits equal an engine without
    LoRA bit for bit, and the adapter's delta (float32, beside the quantized
    product) moves its request to peft's within the quantization's error.
    Both engines under backend.batch_invariant: a step with an adapter runs
    the composed layers, and without it the engine without LoRA runs the
    compiled layer, whose q8_0 products on AVX-512 may part from the composed
    ones in the last bit."""
    path, a, _ = tiny
    plain, tap0 = tapped(path, quantization=quantization, batch_invariant=True)
    lora, tap1 = tapped(path, quantization=quantization, batch_invariant=True, **LORA)
    _, want = run(plain, tap0, PROMPTS[:2], [None, None])
    _, got = run(lora, tap1, PROMPTS[:2], [None, LoRARequest("a", 1, a)])
    assert np.array_equal(got[0], want[0])
    assert np.abs(got[1][0] - want[1][0]).max() > 1e-2
    ref = peft_logits(path, a, PROMPTS[1])[-1]
    assert np.abs(got[1][0] - ref).max() < 0.15 * np.abs(ref).max()   # the base's rounding only


def test_bad_adapters_are_refused_with_the_reason(tiny, tmp_path):
    path, a, b = tiny
    llm = LLM(str(path), **{**ENGINE, **LORA, "max_lora_rank": 4})
    eng = llm.engine

    def refused(lr, *words):
        with pytest.raises(ValueError) as e:
            eng.load_lora_adapter(lr)
        for w in words:
            assert w in str(e.value), str(e.value)
        assert lr.lora_name not in eng.lora.known and lr.lora_name not in eng.lora.loaded
    refused(LoRARequest("big", 3, b), "rank 8", "max_lora_rank=4")
    refused(LoRARequest("none", 4, str(tmp_path / "nowhere")), "no such folder")
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(a, broken)
    (broken / "adapter_model.safetensors").unlink()
    refused(LoRARequest("broken", 5, str(broken)), "adapter_model.safetensors is missing")
    from safetensors.numpy import load_file, save_file
    shaped = tmp_path / "shaped"
    shutil.copytree(a, shaped)
    t = load_file(str(a) + "/adapter_model.safetensors")
    key = next(k for k in t if "q_proj.lora_B" in k)
    t[key] = np.zeros((t[key].shape[0] + 1, t[key].shape[1]), np.float32)
    save_file(t, str(shaped / "adapter_model.safetensors"))
    refused(LoRARequest("shaped", 6, str(shaped)), "q_proj", "lora_B [33, 4]")
    odd = tmp_path / "odd"
    shutil.copytree(a, odd)
    t = load_file(str(a) + "/adapter_model.safetensors")
    t = {k.replace("gate_proj", "gate_up_proj"): v for k, v in t.items()}
    save_file(t, str(odd / "adapter_model.safetensors"))
    refused(LoRARequest("odd", 7, str(odd)), "gate_up_proj", "does not adapt")
    dora = tmp_path / "dora"
    shutil.copytree(a, dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    refused(LoRARequest("dora", 8, str(dora)), "use_dora")
    eng.load_lora_adapter(LoRARequest("a", 1, a))         # a good one still loads
    assert "a" in eng.lora.loaded


def test_slots_evict_the_least_recently_used_idle_adapter(tiny):
    """max_loras=1: a second adapter evicts the first once it is idle; with
    the first in use by an unfinished request, the second is refused."""
    path, a, b = tiny
    llm = LLM(str(path), **{**ENGINE, "enable_lora": True, "max_loras": 1, "max_lora_rank": 8})
    eng = llm.engine
    ra, rb = LoRARequest("a", 1, a), LoRARequest("b", 2, b)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), lora_request=ra)
    assert list(eng.lora.loaded) == ["a"]
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), lora_request=rb)
    assert list(eng.lora.loaded) == ["b"]
    again = llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), lora_request=ra)
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_loras=1"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}] * 2, greedy(), lora_request=[ra, rb])
    assert not eng.has_unfinished() and not eng.lora.users
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(path), **ENGINE).generate([{"prompt_token_ids": PROMPTS[0]}], greedy(), lora_request=ra)


@pytest.mark.slow
def test_outside_loader_is_selected_by_config(tiny, tmp_path, monkeypatch):
    """``lora.lora_loader`` names a loader an outside package registers
    (tests/plugin_pkg's ``example-npz``): adapter a written in its format
    runs bit for bit as the peft folder does; an unknown loader name is a
    config error naming the key."""
    from conftest import PLUGIN_PKG
    from fdx.core.config import ConfigError
    from fdx.core.plugins import BUILTIN_PLUGINS
    from fdx.plugins.lora.peft_loader import PeftLoader
    monkeypatch.syspath_prepend(str(PLUGIN_PKG))
    from fdx_example_plugin.lora_loader import save_npz
    path, a, _ = tiny
    w = PeftLoader().load(a)
    save_npz(str(tmp_path / "a-npz"), w.rank, w.scale, w.modules)
    pm = PluginManager(builtins=BUILTIN_PLUGINS + ("fdx_example_plugin.lora_loader",), load_entry_points=False)
    tap = LogitsTap()
    pm.add_plugin(tap, name="tap")
    llm = LLM(str(path), plugins=pm, capture_logits=True, lora_loader="example-npz", **{**ENGINE, **LORA})
    _, got = run(llm, tap, [PROMPTS[0]], [LoRARequest("a", 1, str(tmp_path / "a-npz"))])
    ref, ref_tap = tapped(path, **LORA)
    _, want = run(ref, ref_tap, [PROMPTS[0]], [LoRARequest("a", 1, a)])
    assert np.array_equal(got[0], want[0])
    with pytest.raises(ConfigError, match="lora.lora_loader"):
        LLM(str(path), plugins=pm, lora_loader="no-such-loader", **{**ENGINE, **LORA})


@pytest.mark.slow
def test_tp2_gives_the_same_greedy_tokens(tiny):
    """Two ranks, each holding its shard of both adapters (A of o_proj and
    down_proj split by input, B of q/k/v and gate/up by output): the mixed
    batch's greedy tokens equal TP 1's; a bad adapter is refused on every
    rank with the reason."""
    path, a, b = tiny
    loras = [LoRARequest("a", 1, a), None, LoRARequest("b", 2, b)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in LLM(str(path), **{**ENGINE, **LORA}).generate(prompts, greedy(6),
                                                                                          lora_request=loras)]
    with LLM(str(path), tensor_parallel_size=2, **{**ENGINE, **LORA}) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(6), lora_request=loras)]
        with pytest.raises(ValueError, match="no such folder"):
            llm.engine.load_lora_adapter(LoRARequest("gone", 3, a + "-gone"))
    assert got == want


@pytest.mark.slow
def test_http_model_field_load_and_unload(tiny, tmp_path):
    """A real ``fdx serve --enable-lora --lora-modules`` (name=path and vLLM's
    JSON form): /v1/models lists the adapters with their parent; the model
    field picks the adapter (the same text as LLM.generate with it); load and
    unload need the API key; a bad adapter is a 400 with the reason; an
    unknown model name is a 404 as OpenAI's."""
    import subprocess
    import sys

    import httpx
    from serve_utils import API_KEY, free_port, terminate, wait_for
    path, a, b = tiny
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fdx.entrypoints.cli", "serve", "--model", str(path), "--port", str(port),
         "--enable-lora", "--lora-modules", f"a={a}", json.dumps({"name": "b", "path": b}),
         "--max-loras", "2", "--max-lora-rank", "8", "--max-model-len", "128", "--num-kv-blocks", "64",
         "--block-size", "4", "--set", f"server.api_key={API_KEY}", "--set", "server.log_level=warning"],
        stdout=log, stderr=subprocess.STDOUT)
    auth = {"Authorization": f"Bearer {API_KEY}"}

    def healthy(http) -> bool:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        try:
            return http.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            return False
    try:
        with httpx.Client(timeout=2) as http:  # one client for the polls (httpx.get builds an SSL context a call)
            wait_for(lambda: healthy(http), 240, "fdx serve to answer /health")
        models = httpx.get(url + "/v1/models", headers=auth).json()["data"]
        base = models[0]["id"]
        assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("a", base), ("b", base)]
        assert models[1]["root"] == a

        def complete(model):
            r = httpx.post(url + "/v1/completions", headers=auth, timeout=60, json={
                "model": model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            return r.status_code, r.json()
        llm = LLM(str(path), **{**ENGINE, **LORA})
        want = {lr: llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(),
                                 lora_request=None if lr is None else LoRARequest(lr, i + 1, (a, b)[i]))[0]
                .outputs[0].text for i, lr in enumerate(["a", "b", None])}
        for model, lr in (("a", "a"), ("b", "b"), (base, None)):
            status, body = complete(model)
            assert status == 200 and body["choices"][0]["text"] == want[lr], body
        assert want["a"] != want[None]
        status, body = complete("nope")
        assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"

        assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": a}).status_code == 401
        r = httpx.post(url + "/v1/load_lora_adapter", headers=auth,
                       json={"lora_name": "c", "lora_path": str(tmp_path / "missing")})
        assert r.status_code == 400 and "no such folder" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/load_lora_adapter", headers=auth, json={"lora_name": "c"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        r = httpx.post(url + "/v1/load_lora_adapter", headers=auth, json={"lora_name": "c", "lora_path": a},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert complete("c")[1]["choices"][0]["text"] == want["a"]      # a third adapter: one evicted, reloaded
        assert complete("b")[1]["choices"][0]["text"] == want["b"]
        assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 401
        assert httpx.post(url + "/v1/unload_lora_adapter", headers=auth,
                          json={"lora_name": "c"}).status_code == 200
        assert complete("c")[0] == 404
        assert httpx.post(url + "/v1/unload_lora_adapter", headers=auth,
                          json={"lora_name": "c"}).status_code == 404
        assert [m["id"] for m in httpx.get(url + "/v1/models", headers=auth).json()["data"]] == [base, "a", "b"]
    finally:
        terminate(proc, 30)
        log.close()


def test_prefix_cache_keeps_adapters_apart(tiny):
    """kv_cache prefix: the base model's blocks of a prompt are not reused for
    the same prompt under an adapter (its KV differs): the adapter's run after
    the base's equals its run on a fresh engine, bit for bit."""
    path, a, _ = tiny
    prompt, ra = list(range(3, 30)), LoRARequest("a", 1, a)
    llm, tap = tapped(path, kv_cache="prefix", **LORA)
    base_tokens, _ = run(llm, tap, [prompt], [None])
    tokens, got = run(llm, tap, [prompt], [ra])
    fresh, fresh_tap = tapped(path, kv_cache="prefix", **LORA)
    want_tokens, want = run(fresh, fresh_tap, [prompt], [ra])
    assert tokens == want_tokens != base_tokens and np.array_equal(got[0], want[0])
