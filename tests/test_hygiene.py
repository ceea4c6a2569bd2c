"""The suite's own promises (tests/conftest.py): a test that dies by a
signal in a kernel is named in the output; a run leaves the Python
environment as it found it, and fails when a test changed it; the
third-party test plugin is the session's own copy, not an install."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


def run_pytest(python: str, folder: pathlib.Path, test_file: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m pytest -q` on one small file, with this suite's conftest."""
    (folder / "pytest.ini").write_text("[pytest]\n")           # its own rootdir, no addopts
    (folder / "test_it.py").write_text(test_file)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([python, "-m", "pytest", "-q", "-p", "conftest", *args, "test_it.py"], cwd=folder,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_test_that_dies_by_sigill_after_paddle_is_named(tmp_path):
    out = run_pytest(sys.executable, tmp_path, '''
import os
import signal

def test_first():
    pass

def test_kernel_that_dies():
    import paddle
    assert float((paddle.ones([4, 4]) @ paddle.ones([4, 4])).sum()) == 64    # Paddle has run
    os.kill(os.getpid(), signal.SIGILL)
''')
    text = out.stdout + out.stderr
    assert out.returncode == -4, (out.returncode, text)
    assert "Fatal Python error: Illegal instruction" in text, text
    assert f"{tmp_path / 'test_it.py'}\", line 11 in test_kernel_that_dies" in text, text


@pytest.mark.slow
def test_a_run_that_installs_something_fails(tmp_path):
    """In a virtualenv of its own, a test writes a distribution into that
    virtualenv's site-packages: the run fails and says what was added.
    (Without faulthandler, so the conftest does not import Paddle: the
    check of the environment does not need it.)"""
    from conftest import make_venv
    py = make_venv(tmp_path / "venv", with_pip=False)
    out = run_pytest(str(py), tmp_path, '''
import pathlib
import sysconfig

def test_installs():
    dist = pathlib.Path(sysconfig.get_paths()["purelib"]) / "left_behind-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\\nName: left-behind\\nVersion: 1.0\\n")
''', "-p", "no:faulthandler")
    text = out.stdout + out.stderr
    assert "1 passed" in text and out.returncode == 1, (out.returncode, text)
    assert "the test run changed the Python environment it ran in:" in text
    assert f"added left-behind 1.0 in {tmp_path / 'venv'}" in text, text


def test_the_example_plugin_is_the_sessions_copy(example_plugin_installed):
    import importlib.metadata

    import fdx_example_plugin
    from conftest import installed_distributions
    assert pathlib.Path(fdx_example_plugin.__file__).is_relative_to(example_plugin_installed)
    (ep,) = [ep for ep in importlib.metadata.entry_points(group="fdx") if ep.name == "example"]
    assert ep.dist.locate_file("") == example_plugin_installed
    assert str(example_plugin_installed) not in {folder for _, _, folder in installed_distributions()}
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(example_plugin_installed)   # for subprocesses
