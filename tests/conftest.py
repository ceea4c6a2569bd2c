"""Shared fixtures. Heavy objects (the SmolLM2 engine) are built once per session."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PLUGIN_PKG = ROOT / "tests" / "plugin_pkg"

# Fixtures that load SmolLM2, build torch reference models, install a package
# or start a server: a test that uses one is marked slow, so that
# `python -m pytest -m "not slow"` stays the quick subset. Tests that start a
# subprocess themselves carry @pytest.mark.slow.
SLOW_FIXTURES = {
    "smollm_llm", "smollm", "smollm_reference", "hf_smollm", "hf_smollm_model", "hf_logits",
    "tiny_checkpoints", "smollm_hf_tokenizer_dir", "example_plugin_installed", "server", "case", "ref",
    "browser", "built_wheel", "tiny_model",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        compiled = isinstance(params.get("impl"), (tuple, str)) and "cpp" in str(params.get("impl"))
        if SLOW_FIXTURES.intersection(getattr(item, "fixturenames", ())) or compiled:
            item.add_marker(pytest.mark.slow)


def _plugin_up_to_date() -> bool:
    """Whether the installed test plugin is this checkout's (same files)."""
    import importlib.util
    importlib.invalidate_caches()
    if not any(ep.name == "example" for ep in importlib.metadata.entry_points(group="fdx")):
        return False
    spec = importlib.util.find_spec("fdx_example_plugin")
    if spec is None or not spec.submodule_search_locations:
        return False
    installed = pathlib.Path(list(spec.submodule_search_locations)[0])
    source = PLUGIN_PKG / "fdx_example_plugin"
    files = sorted(p.relative_to(source) for p in source.rglob("*.py"))
    return files == sorted(p.relative_to(installed) for p in installed.rglob("*.py")) and all(
        (source / f).read_bytes() == (installed / f).read_bytes() for f in files)


@pytest.fixture(scope="session")
def example_plugin_installed():
    """Install the third-party test plugin with pip, as a user would
    (again when the installed copy is not this checkout's)."""
    if not _plugin_up_to_date():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--force-reinstall", str(PLUGIN_PKG)], check=True)
        assert _plugin_up_to_date()
        for name in [m for m in sys.modules if m == "fdx_example_plugin" or m.startswith("fdx_example_plugin.")]:
            del sys.modules[name]                # an old copy imported earlier in this session
        import fdx.core.plugins
        fdx.core.plugins._default = None         # built before the install: rebuild with it
        fdx.core.plugins._serving = None
    yield


@pytest.fixture(scope="session")
def smollm_llm():
    """One SmolLM2 engine for the session: small pool, sized for tests."""
    from fdx import LLM
    return LLM(max_model_len=512, max_num_seqs=16, num_kv_blocks=256, block_size=16, progress=False)


def smollm_gguf_path() -> str:
    from fdx.core.checkpoint.loader import default_model_path
    return default_model_path()


TINY_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Ernie4_5ForCausalLM")


def tiny_hf_config(arch: str, tie: bool = True):
    """A tiny config of each architecture, with the SmolLM2 vocabulary."""
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=tie, initializer_range=0.1,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "LlamaForCausalLM":
        return transformers.LlamaConfig(rope_theta=10000.0, **common)
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(rope_theta=1e6, **common)
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(head_dim=32, rope_theta=1e6, **common)
    if arch == "Ernie4_5ForCausalLM":
        return transformers.Ernie4_5Config(head_dim=16, rope_theta=500000.0, use_bias=False, **common)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def smollm_hf_tokenizer_dir(tmp_path_factory):
    """The SmolLM2 tokenizer as transformers reads it from the GGUF, saved as
    an HF tokenizer folder (tokenizer.json, tokenizer_config.json)."""
    import transformers
    path = pathlib.Path(smollm_gguf_path())
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    out = tmp_path_factory.mktemp("smollm_tok")
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, smollm_hf_tokenizer_dir):
    """A tiny random Llama (2 layers, hidden 64) with a 4096-token context,
    so that a stream can stay open for a while."""
    import shutil

    import torch
    import transformers
    cfg = tiny_hf_config("LlamaForCausalLM")
    cfg.max_position_embeddings = 4096
    torch.manual_seed(13)
    d = tmp_path_factory.mktemp("tiny_llama_4k")
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(str(d), safe_serialization=True)
    for f in smollm_hf_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return str(d)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory, smollm_hf_tokenizer_dir):
    """arch -> (HF dir written by transformers, the torch model) for each architecture."""
    import shutil
    import torch
    import transformers
    out = {}
    for i, arch in enumerate(TINY_ARCHS):
        torch.manual_seed(1234 + i)
        cfg = tiny_hf_config(arch, tie=(i % 2 == 0))
        model = getattr(transformers, arch)(cfg).eval()
        d = tmp_path_factory.mktemp(arch)
        model.save_pretrained(str(d), safe_serialization=True)
        for f in smollm_hf_tokenizer_dir.iterdir():
            shutil.copy(f, d / f.name)
        out[arch] = (d, model)
    return out


@pytest.fixture(scope="session")
def hf_smollm_model():
    import torch
    import transformers
    path = pathlib.Path(smollm_gguf_path())
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_logits(hf_smollm_model):
    """ids -> float64 log-softmax of transformers' logits at every position."""
    import numpy as np
    import torch

    def run(ids):
        with torch.no_grad():
            logits = hf_smollm_model(torch.tensor([ids])).logits[0].double().numpy()
        m = logits.max(-1, keepdims=True)
        return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
    return run
