"""One log format, with the time, for the CLI, the engine process, the
router, uvicorn and the Python API (fdx.core.logs)."""
from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest

from fdx.core import logs

LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING) ([\w.]+)(\[tp1\])?: (.*)")


def _format(handler: logging.Handler, name: str, msg: str, level=logging.INFO) -> str:
    return handler.format(logging.LogRecord(name, level, __file__, 1, msg, None, None))


def test_an_entry_point_logs_fdx_and_uvicorn_lines_with_their_time():
    logs.configure("info", tag="[tp1]")
    fdx = logging.getLogger("fdx")
    (handler,) = [h for h in fdx.handlers if getattr(h, "_fdx", False)]
    m = LINE.fullmatch(_format(handler, "fdx.backends.cpu", "kernels: ..."))
    assert m and m.group(2) == "fdx.backends.cpu" and m.group(3) == "[tp1]" and m.group(4) == "kernels: ..."
    assert fdx.level == logging.INFO and not fdx.propagate
    logs.configure("warning")                                  # again: still one handler of fdx's own
    assert len([h for h in fdx.handlers if getattr(h, "_fdx", False)]) == 1 and fdx.level == logging.WARNING
    from uvicorn.config import LOGGING_CONFIG
    assert LOGGING_CONFIG["formatters"]["default"]["fmt"] == logs.FORMAT


def test_the_python_api_leaves_a_programs_own_logging_alone():
    """Under pytest the root logger has pytest's handlers: the program's own
    set-up, which configure_api must not bypass (caplog sees fdx's lines)."""
    fdx = logging.getLogger("fdx")
    before = (list(fdx.handlers), fdx.propagate)
    logs.configure_api()
    assert (list(fdx.handlers), fdx.propagate) == before


@pytest.mark.slow
def test_the_python_api_and_the_cli_log_in_the_same_format(tmp_path):
    """LLM(...) in a program that set up no logging (Paddle's import installs
    a root handler of its own format), and `fdx generate`: the same lines."""
    from tiny_models import TinyLlama
    model = TinyLlama().hf_dir(tmp_path / "m")
    api = subprocess.run([sys.executable, "-c", "import paddle\nfrom fdx import LLM\n"
                          f"LLM({str(model)!r}, max_model_len=64, num_kv_blocks=8, progress=False)"],
                         capture_output=True, text=True, timeout=600)
    cli = subprocess.run([sys.executable, "-m", "fdx.entrypoints.cli", "generate", "w3 w4", "--model", str(model),
                          "--max-tokens", "2", "--max-model-len", "64", "--num-kv-blocks", "8"],
                         capture_output=True, text=True, timeout=600)
    assert api.returncode == 0 and cli.returncode == 0, api.stderr + cli.stderr
    for out in (api.stderr, cli.stderr):
        fdx_lines = [line for line in out.splitlines() if " fdx." in line]
        assert any("kernels: " in line for line in fdx_lines), out
        for line in fdx_lines:
            assert LINE.fullmatch(line), line
