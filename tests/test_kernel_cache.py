"""The compiled-kernel cache loads only what fdx built, from a folder it
trusts (issue 35 item 2; fdx.ops.kernel_cache): the attack replayed (a
planted ``fdx_ops_<key>.so`` whose constructor writes a marker, in a folder
owned by another user with mode 0777; a tampered object in a trusted
folder), in child processes, with one real build for the module."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fdx.ops import kernel_cache

NOBODY = 65534


# -- the folder checks (no build) ---------------------------------------------------------------

def test_a_folder_is_trusted_only_if_it_and_everything_below_the_root_is_this_users_and_private(tmp_path):
    root = tmp_path / "cache"
    leaf = root / "ops" / "key"
    assert kernel_cache.check_dir(leaf, root, create=True) is None
    for p in (root, root / "ops", leaf):
        assert p.is_dir() and (p.stat().st_mode & 0o777) == 0o700       # made by fdx, private
    (root / "ops").chmod(0o777)
    assert "writable by group or others (mode 0777)" in kernel_cache.check_dir(leaf, root)
    (root / "ops").chmod(0o755)                           # readable by others is fine, writable is not
    assert kernel_cache.check_dir(leaf, root) is None
    os.chown(leaf, NOBODY, -1)
    assert f"{leaf} is owned by uid {NOBODY}" in kernel_cache.check_dir(leaf, root)
    os.chown(leaf, os.geteuid(), -1)
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    shutil.rmtree(leaf)
    leaf.symlink_to(real)
    assert f"{leaf} is a symlink" in kernel_cache.check_dir(leaf, root)
    # above the root: a folder others may write without the sticky bit
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "above the cache" in kernel_cache.check_dir(shared / "cache" / "ops", shared / "cache", create=True)
    shared.chmod(0o1777)
    assert kernel_cache.check_dir(shared / "cache" / "ops", shared / "cache", create=True) is None


def test_an_object_is_loadable_only_with_its_builds_record(tmp_path):
    so = tmp_path / "lib.so"
    so.write_bytes(b"\x7fELF built")
    assert "no record of its hash" in kernel_cache.check_object(so)
    kernel_cache.record(so)
    assert kernel_cache.check_object(so) is None
    so.write_bytes(b"\x7fELF changed")
    assert "does not match the record" in kernel_cache.check_object(so)
    kernel_cache.record(so)
    so.chmod(0o666)
    assert "writable by group or others" in kernel_cache.check_object(so)


# -- the attack, with real builds ------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import json, logging, sys
    import numpy as np
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import paddle
    from fdx.ops import cpp
    status = cpp.prepare()
    x = np.random.default_rng(0).standard_normal((3, 16)).astype("float32")
    got = cpp.silu_and_mul(paddle.to_tensor(x)).numpy().tolist() if cpp.available() else None
    print(json.dumps({"status": status, "available": cpp.available(), "x": x.tolist(), "got": got}))
""")


def run_child(cache: Path, marker: Path, **env_changes: str) -> tuple[dict, str]:
    env = {**os.environ, "FDX_CACHE_DIR": str(cache), **env_changes}
    env.pop("FDX_DISABLE_CPP_OPS", None)
    env.pop(kernel_cache.PRIVATE_ENV, None)
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "PATH" in env_changes:                           # no compiler found: the Paddle path, nothing loaded
        return out, p.stderr
    x = __import__("numpy").asarray(out["x"], dtype="float32")
    half = x.shape[1] // 2
    ref = x[:, :half] / (1 + __import__("numpy").exp(-x[:, :half])) * x[:, half:]    # numpy reference
    assert out["available"]
    assert __import__("numpy").allclose(out["got"], ref, rtol=1e-5, atol=1e-5), "the kernels do not work"
    return out, p.stderr


def key_of(cache: Path) -> str:
    code = "from fdx.ops import cpp; print(cpp.build_dir().name)"
    p = subprocess.run([sys.executable, "-c", code], env={**os.environ, "FDX_CACHE_DIR": str(cache)},
                       capture_output=True, text=True, check=True, timeout=300)
    return p.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[Path, Path]:
    """A shared object whose constructor writes a marker file: what an attacker plants."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("planted")
    marker = d / "constructor-ran"
    (d / "evil.c").write_text(textwrap.dedent(f"""
        #include <stdio.h>
        __attribute__((constructor)) static void planted(void) {{
            FILE *f = fopen("{marker}", "a");
            if (f) {{ fputs("ran\\n", f); fclose(f); }}
        }}
    """))
    subprocess.run([gcc, "-shared", "-fPIC", "-o", str(d / "evil.so"), str(d / "evil.c")], check=True)
    return d / "evil.so", marker


def plant(folder: Path, name: str, evil: Path) -> Path:
    (folder / name).mkdir(parents=True, exist_ok=True)
    so = folder / name / f"{name}.so"
    shutil.copy(evil, so)
    (folder / ".built").touch()
    return so


@pytest.fixture(scope="module")
def foreign_attack(tmp_path_factory, planted):
    """The attack as found: FDX_CACHE_DIR at a folder another user owns,
    mode 0777, holding a planted object under the expected name (and a
    record of its hash: whoever can write the folder can write that too)."""
    evil, marker = planted
    cache = tmp_path_factory.mktemp("foreign") / "cache"
    key = key_of(cache)
    folder = cache / "ops" / key
    folder.mkdir(parents=True)
    so = plant(folder, f"fdx_ops_{key}", evil)
    kernel_cache.record(so)
    for p in [cache, cache / "ops", folder, folder / so.parent.name]:
        os.chown(p, NOBODY, NOBODY)
        p.chmod(0o777)
    for p in (so, kernel_cache._record_path(so), folder / ".built"):
        os.chown(p, NOBODY, NOBODY)
        p.chmod(0o666)
    out, log = run_child(cache, marker)
    return cache, key, out, log, marker


@pytest.mark.slow
def test_a_planted_object_in_a_foreign_world_writable_folder_is_not_loaded(foreign_attack):
    cache, key, out, log, marker = foreign_attack
    assert not marker.exists(), "the planted object's constructor ran"
    assert f"not loading anything from {cache / 'ops' / key}" in log
    assert f"owned by uid {NOBODY}, not by this user" in log
    assert "built the compiled CPU kernels" in out["status"]         # rebuilt privately, and they work


def path_without_a_compiler(folder: Path) -> Path:
    """A folder of links to every program on PATH but c++ and g++ (where
    fdx looks for a compiler): the child finds the other tools (cpu_id and
    Paddle's probes read /proc with cat and grep), and no compiler."""
    folder.mkdir()
    for d in os.environ["PATH"].split(os.pathsep):
        if os.path.isdir(d):
            for name in os.listdir(d):
                if name not in ("c++", "g++") and not (folder / name).exists():
                    (folder / name).symlink_to(Path(d, name))
    return folder


@pytest.mark.slow
def test_a_tampered_object_in_a_trusted_folder_is_removed_not_loaded(foreign_attack, planted, tmp_path):
    """A trusted cache (this user's, 0700) seeded with a genuine build and its
    record: loaded on the next start without a build. The object is then
    replaced: removed and rebuilt, not loaded. The rebuild is the one the
    foreign attack's test ran (a build in a refused folder's place); here no
    compiler is on PATH, so the start ends on the Paddle path with the
    tampered object gone (one extension build for the module, not two)."""
    evil, marker = planted
    _, key, out, log, _ = foreign_attack
    private = Path(next(line for line in log.splitlines() if "private folder" in line)
                   .split("private folder, ")[1].split(", instead")[0])
    cache = tmp_path / "cache"
    folder = cache / "ops" / key
    (cache / "ops").mkdir(parents=True, mode=0o700)
    cache.chmod(0o700)
    shutil.copytree(private, folder)
    folder.chmod(0o700)
    name = f"fdx_ops_{key}"
    so = folder / name / f"{name}.so"
    assert kernel_cache.check_object(so) is None    # the genuine build and its record

    again, log2 = run_child(cache, marker)
    assert "loaded the compiled CPU kernels" in again["status"] and "not loading" not in log2

    shutil.copy(evil, so)                           # tampered after the build: the record no longer matches
    out3, log3 = run_child(cache, marker, PATH=str(path_without_a_compiler(tmp_path / "bin")), CXX="c++")
    assert not marker.exists(), "the tampered object's constructor ran"
    assert f"not loading {so}: its sha256 does not match the record" in log3 and "rebuilding it" in log3
    assert not so.exists() and not kernel_cache._record_path(so).exists()     # nothing left to load by mistake
    assert not out3["available"] and "no C++ compiler" in out3["status"], out3["status"]
