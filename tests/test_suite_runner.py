"""The suite's runner (tests/conftest.py, tests/README.md "Two processes"):
on two processes, the modules that use the session's SmolLM2 run on one of
them, whatever pytest does with xdist's node-id groups."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent

# Each module records the process it ran on. Two use a fixture named like the
# session's SmolLM2 (a stand-in of their own: nothing is loaded), one does not.
HEAVY = '''
import json, os, pytest

@pytest.fixture(scope="session")
def {fixture}():
    return "stand-in"

def test_it({fixture}):
    with open(os.environ["RUNNER_OUT"], "a") as f:
        f.write(json.dumps([__name__, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
'''


@pytest.mark.slow
def test_the_smollm_modules_share_one_process(tmp_path):
    """Under xdist's own scheduling by module, test_a and test_b (first in
    the order, as every SmolLM2 module is) go to the two processes: two
    SmolLM2 loads. conftest's scheduler keeps them on one. (Without
    faulthandler, so that the conftest does not import Paddle.)"""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")           # its own rootdir, no addopts
    (tmp_path / "test_a.py").write_text(HEAVY.format(fixture="smollm_llm"))
    (tmp_path / "test_b.py").write_text(HEAVY.format(fixture="hf_smollm_model"))
    (tmp_path / "test_c.py").write_text(HEAVY.format(fixture="something_light"))
    out_file = tmp_path / "ran.jsonl"
    env = {**os.environ, "RUNNER_OUT": str(out_file),
           "PYTHONPATH": os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("FDX_TEST_MEASURE", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:faulthandler",
                          "-p", "no:cacheprovider", "test_c.py", "test_b.py", "test_a.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "3 passed" in text, text
    ran = dict(json.loads(line) for line in out_file.read_text().splitlines())
    assert set(ran) == {"test_a", "test_b", "test_c"}, ran
    assert ran["test_a"] == ran["test_b"] is not None, ran           # a worker (more than one file: two)
    assert ran["test_c"] not in (None, ran["test_a"]), ran           # the other process: one unit each
