"""Guards: the wheel's package list matches the folders, and nothing
imports the card's folders as top-level names."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOP = {"core", "plugins", "ops", "entrypoints", "model_io"}


def _source_files():
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"tests", "build", "docs", ".git"} or any(p.startswith(".") for p in rel.parts):
            continue
        yield path


def test_package_list_matches_folders_with_init():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = set(conf["tool"]["setuptools"]["packages"])
    on_disk = {"fdx"}
    for init in ROOT.rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if not rel.parts or rel.parts[0] in {"tests", "build", "docs"} or any(p.startswith(".") for p in rel.parts):
            continue
        on_disk.add("fdx." + ".".join(rel.parts))
    assert declared == on_disk


def test_console_script_and_package_data_name_what_exists():
    """The `fdx` command's target is a callable in a declared package, and
    each package-data entry names a declared package whose files are on
    disk (a moved package leaves neither pointing at the old place)."""
    import glob
    import importlib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = set(conf["tool"]["setuptools"]["packages"])
    module, _, attr = conf["project"]["scripts"]["fdx"].partition(":")
    assert module.rpartition(".")[0] in declared
    assert callable(getattr(importlib.import_module(module), attr))
    for package, patterns in conf["tool"]["setuptools"]["package-data"].items():
        assert package in declared, package
        folder = ROOT.joinpath(*package.split(".")[1:])
        for pattern in patterns:
            assert glob.glob(str(folder / pattern)), f"{package}: nothing matches {pattern}"


def test_no_top_level_imports_of_card_folders():
    offenders = []
    for path in list(_source_files()) + list((ROOT / "tests").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    offenders.append(f"{path}:{node.lineno} relative import")
                    continue
                names = [node.module or ""]
            else:
                continue
            for n in names:
                if n.split(".")[0] in TOP:
                    offenders.append(f"{path}:{node.lineno} imports {n}")
    assert not offenders, offenders


def test_tests_folder_has_no_init():
    assert not (ROOT / "tests" / "__init__.py").exists()


def test_fdx_is_the_repo_root():
    import fdx
    assert pathlib.Path(fdx.__file__).resolve().parent == ROOT


@pytest.mark.slow
def test_serving_never_loads_torch_even_where_it_is_installed():
    """Paddle 3.3's import tries tvm_ffi (installed with xgrammar), which
    imports torch: every fdx process carried torch (about 190 MB resident and
    seconds of start-up) though serving never uses it. fdx refuses tvm_ffi
    while Paddle imports (Paddle takes the same DLPack capsule without it);
    xgrammar still imports both afterwards."""
    import importlib.util
    if importlib.util.find_spec("tvm_ffi") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs tvm_ffi and torch installed, where the leak happened")
    code = ("import sys\n"
            "from fdx.core.engine import EngineCore\n"
            "import fdx.plugins.backends.cpu, fdx.plugins.models.llama, paddle\n"
            "assert paddle.to_tensor([2.0]).numpy()[0] == 2.0\n"
            "print('torch' in sys.modules, 'tvm_ffi' in sys.modules)\n"
            "import xgrammar\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False", "True"], out.stdout
