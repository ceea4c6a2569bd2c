"""Names people already know, on real servers.

- The issue's vLLM command line (`vllm serve M --max-model-len 4096
  --max-num-seqs 64 --enable-prefix-caching --tensor-parallel-size 2`) as
  `fdx serve M ...` on a tiny model whose head counts 2 divides: a
  completion answers through the openai client. The same server answers
  /tokenize and /detokenize (checked against transformers' tokenizer of
  the same folder), refuses /v1/embeddings (it generates), and accepts
  `logit_bias` (docs/serving.md's refused list is checked against it).
- An embed server (`--task embed`, tiny random Qwen3, last-token pooling,
  normalized, as Qwen3-Embedding): `client.embeddings.create` equals
  transformers' pooled final hidden states (1e-4), float and base64;
  token-id inputs; `dimensions` refused; generation refused.
"""
from __future__ import annotations

import base64
import os
import pathlib
import re
import subprocess
import sys

import httpx
import numpy as np
import pytest

from serve_utils import API_KEY, ServerProcess, free_port, terminate

pytestmark = pytest.mark.slow
DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")        # --chat-template, inline


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    import time
    port = free_port()
    log = tmp_path_factory.mktemp("vllm_line") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fdx.entrypoints.cli", "serve", str(tiny_model), "--max-model-len", "4096",
             "--max-num-seqs", "64", "--enable-prefix-caching", "--tensor-parallel-size", "2",
             "--port", str(port), "--api-key", API_KEY, "--uvicorn-log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-4000:]
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        terminate(proc, 30)
        raise RuntimeError(log.read_text()[-4000:])
    yield base, tiny_model
    terminate(proc, 30)


def test_the_vllm_command_line_serves_a_completion(vllm_server):
    from openai import OpenAI
    base, _ = vllm_server
    client = OpenAI(base_url=base + "/v1", api_key=API_KEY)
    (model,) = client.models.list().data
    assert model.max_model_len == 4096
    r = client.completions.create(model=model.id, prompt="Hello, my name is", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    metrics = httpx.get(base + "/metrics").text
    assert "fdx:prefix_cache_queries_total" in metrics                # --enable-prefix-caching took
    engine_stats = httpx.get(base + "/v1/engine/stats", headers=AUTH).json()
    assert engine_stats["prefix_cache"] is not None


def test_each_metric_row_of_migrating_md_names_a_series_the_server_exports(vllm_server):
    from test_migrating import metric_rows
    base, _ = vllm_server
    # series that appear only once a request has finished (success counts, prefix-cache hits): two
    # completions of one prompt of its own, so that the test does not rely on another having run first
    model = httpx.get(base + "/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
    for _ in range(2):
        r = httpx.post(base + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": model, "prompt": "Names people already know, on real servers.",
                             "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    text = httpx.get(base + "/metrics").text
    series = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    missing = [name for _, name in metric_rows() if name not in series and f"{name}_bucket" not in series]
    assert missing == []


def test_tokenize_and_detokenize_round_trip_against_transformers(vllm_server):
    import transformers
    base, path = vllm_server
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    text = "Hello world, the capital of France is Paris. ünïcode 🙂"
    r = httpx.post(base + "/tokenize", json={"prompt": text}, headers=AUTH)
    body = r.json()
    assert r.status_code == 200, body
    assert body["tokens"] == ref(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 4096 and body["token_strs"] is None
    strs = httpx.post(base + "/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                "return_token_strs": True}, headers=AUTH).json()
    assert strs["tokens"] == ref(text, add_special_tokens=False)["input_ids"]
    assert strs["token_strs"] == ref.convert_ids_to_tokens(strs["tokens"])
    back = httpx.post(base + "/detokenize", json={"tokens": body["tokens"]}, headers=AUTH).json()
    assert back["prompt"] == ref.decode(body["tokens"])
    assert text in back["prompt"]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    chat = httpx.post(base + "/tokenize", json={"messages": messages}, headers=AUTH).json()
    want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == ref(want, add_special_tokens=False)["input_ids"]
    no_gen = httpx.post(base + "/tokenize", json={"messages": messages, "add_generation_prompt": False},
                        headers=AUTH).json()
    assert len(no_gen["tokens"]) < len(chat["tokens"])

    # behind the key; bad input is a 400 naming the field
    assert httpx.post(base + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.post(base + "/detokenize", json={"tokens": [1]}).status_code == 401
    bad = httpx.post(base + "/detokenize", json={"tokens": [10**9]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    bad = httpx.post(base + "/tokenize", json={"prompt": "x", "nonsense": 1}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "nonsense"
    bad = httpx.post(base + "/tokenize", json={"messages": []}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"


def test_a_generate_server_refuses_embeddings(vllm_server):
    base, _ = vllm_server
    r = httpx.post(base + "/v1/embeddings", json={"input": "hi"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"


def refused_fields() -> list[str]:
    """docs/serving.md's "Not available yet" list, as field names."""
    text = (DOCS / "serving.md").read_text()
    para = text.split("Not available yet, each answered with a 400 that says so:", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"`([a-z_]+)`", para)


REFUSED_BODIES = {   # a body that uses each documented-refused field, and the param its 400 names
    "suffix": ({"suffix": "x"}, "suffix"),
    "best_of": ({"best_of": 3}, "best_of"),
}
QUALIFIERS = {"n"}   # "best_of other than `n`"


def test_the_documented_refused_fields_are_refused_and_logit_bias_works(vllm_server):
    base, _ = vllm_server
    fields = refused_fields()
    assert "logit_bias" not in fields and "suffix" in fields
    for name in fields:
        if name in QUALIFIERS:
            continue
        body, param = REFUSED_BODIES[name]          # a new refused field in the doc needs a body here
        req = {"max_tokens": 2, "prompt": "hi", **body}
        url = base + "/v1/completions"
        r = httpx.post(url, json=req, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (name, r.text)
    r = httpx.post(base + "/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert r.status_code == 400                                  # "non-text message parts"
    # logit_bias works: +100 on one token makes greedy decoding pick it every time
    r = httpx.post(base + "/v1/completions", headers=AUTH, json={
        "prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logit_bias": {"1234": 100}})
    assert r.status_code == 200, r.text
    want = httpx.post(base + "/detokenize", json={"tokens": [1234] * 4}, headers=AUTH).json()["prompt"]
    assert r.json()["choices"][0]["text"] == want


# -- the embed server ---------------------------------------------------------------

@pytest.fixture(scope="module")
def embed_server(tiny_checkpoints, tmp_path_factory):
    path, hf = tiny_checkpoints["Qwen3ForCausalLM"]
    srv = ServerProcess(tmp_path_factory.mktemp("embed"), model={"model": str(path), "task": "embed",
                                                                 "max_model_len": 256,
                                                                 "chat_template": TEMPLATE},
                        scheduler={"max_num_batched_tokens": 16})       # long inputs come in chunks
    try:
        srv.wait_ready()
        yield srv, path, hf
    finally:
        srv.stop()


def test_the_api_process_renders_the_configured_chat_template(embed_server):
    import jinja2
    import transformers
    srv, path, _ = embed_server
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    messages = [{"role": "user", "content": "Hi there"}]
    got = httpx.post(srv.base_url + "/tokenize", json={"messages": messages}, headers=AUTH).json()
    want = jinja2.Template(TEMPLATE).render(messages=messages, add_generation_prompt=True)
    assert got["tokens"] == tok(want, add_special_tokens=False)["input_ids"]


def hf_last_normalized(hf, ids: list[int]) -> np.ndarray:
    import torch
    with torch.no_grad():
        v = hf.model(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return v / np.linalg.norm(v)


def test_openai_embeddings_equal_transformers(embed_server):
    import transformers
    from openai import OpenAI
    srv, path, hf = embed_server
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    client = OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY)
    texts = ["The quick brown fox", "jumps over the lazy dog, again and again and again, for forty tokens " * 2]
    # None: the client asks for base64 itself and decodes it; "base64" given: the caller decodes
    for fmt in (None, "float", "base64"):
        kw = {} if fmt is None else {"encoding_format": fmt}
        r = client.embeddings.create(model=client.models.list().data[0].id, input=texts, **kw)
        assert [d.index for d in r.data] == [0, 1]
        ids = [tok(t)["input_ids"] for t in texts]
        for d, t_ids in zip(r.data, ids):
            got = np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64" else d.embedding
            np.testing.assert_allclose(np.asarray(got), hf_last_normalized(hf, t_ids), atol=1e-4)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    ids = [5, 9, 200, 31, 7]
    r = client.embeddings.create(model=r.model, input=ids)            # token ids
    np.testing.assert_allclose(r.data[0].embedding, hf_last_normalized(hf, ids), atol=1e-4)
    body = httpx.post(srv.base_url + "/v1/embeddings", headers=AUTH,
                      json={"input": [ids, ids[:3]], "encoding_format": "float"}).json()
    assert len(body["data"]) == 2 and body["object"] == "list"
    tagged = httpx.post(srv.base_url + "/v1/embeddings", headers={**AUTH, "X-Request-Id": "emb-trace-7"},
                        json={"input": "hi"})
    assert tagged.json()["id"] == "embd-emb-trace-7" == "embd-" + tagged.headers["x-request-id"]
    np.testing.assert_allclose(body["data"][1]["embedding"], hf_last_normalized(hf, ids[:3]), atol=1e-4)
    stats = httpx.get(srv.base_url + "/v1/engine/stats", headers=AUTH).json()
    assert stats["kv"]["used"] == 0                                 # every pooling request freed its blocks


def test_the_embed_server_refuses_what_it_cannot_do(embed_server):
    srv, _, hf = embed_server
    url = srv.base_url
    r = httpx.post(url + "/v1/embeddings", headers=AUTH, json={"input": "hi", "dimensions": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "dimensions"
    ok = httpx.post(url + "/v1/embeddings", headers=AUTH, json={"input": "hi", "dimensions": hf.config.hidden_size})
    assert ok.status_code == 200
    for body, param in (({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [10**9]}, "input"),
                        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x " * 400}, "input"), ({"input": "hi", "bogus": 1}, "bogus")):
        r = httpx.post(url + "/v1/embeddings", headers=AUTH, json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    r = httpx.post(url + "/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
    r = httpx.post(url + "/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_task"
    assert httpx.post(url + "/v1/embeddings", json={"input": "hi"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200           # nothing above hurt the engine
