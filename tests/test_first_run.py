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

from fdx.core.cli import build_parser, main
from fdx.core.checkpoint.loader import read_gguf

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUPPORTED = "Ernie4_5ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"


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
                                     f"supported: {SUPPORTED}"),
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
        assert err.startswith(line) if name == "corrupt gguf" else err == line + "\n", err
        assert "Traceback" not in err
    with pytest.raises((ValueError, FileNotFoundError, KeyError)) as e:
        LLM(model, num_kv_blocks=8, progress=False)
    assert str(e.value).startswith(message)


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
            out = subprocess.run([sys.executable, "-m", "fdx.core.cli", "serve", "--num-kv-blocks", "8",
                                  "--uvicorn-log-level", "warning", *args],
                                 capture_output=True, text=True, timeout=300, env=env)
            assert out.returncode == 1
            assert f"fdx: error: {message}\n" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr
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
    assert lines == [f"fdx: {status}: using the Paddle attention path, {cpp.PADDLE_PATH_COST}"]
    assert "no C++ compiler" in status


def _flags(parser: argparse.ArgumentParser, name: str = "fdx"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _flags(sub, f"{name} {sub_name}")
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            yield name, action


def test_every_flag_has_help_with_its_default():
    flags = list(_flags(build_parser()))
    assert len(flags) > 60
    missing = [(cmd, a.option_strings) for cmd, a in flags if not a.help or "default" not in a.help]
    assert not missing
