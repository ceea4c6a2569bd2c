"""Trust checks for the compiled-kernel cache (fdx.ops.cpp): fdx loads a
shared object only from a folder it can trust, and only the object its own
build wrote there.

- The folder (``$FDX_CACHE_DIR``, else ``$XDG_CACHE_HOME/fdx``, else
  ``~/.cache/fdx``, then ``ops/<key>``) is created by fdx with mode 0700,
  and checked before anything in it is read: every component from the given
  root (``$FDX_CACHE_DIR`` or ``$XDG_CACHE_HOME``; below the user's home for
  the default) down to the build folder is a real directory (no symlink),
  owned by this user, and not writable by group or others; each folder
  above the root is owned by this user or root, and if group or others may
  write it, it has the sticky bit (as /tmp does), so no one else can rename
  the cache away.
- A built object is loaded only if its sha256 equals the record the build
  wrote beside it (``<name>.so.sha256``, written atomically after the build).
- Anything else is not loaded: in a trusted folder the object is removed
  and rebuilt there; in an untrusted one the kernels are rebuilt in a fresh
  private folder (``tempfile.mkdtemp``, mode 0700), which this process's
  children (probe children, tensor-parallel workers) reuse through
  ``$FDX_KERNEL_CACHE_PRIVATE`` after the same checks. Each case logs one
  warning naming the path and the reason.

docs/security.md#the-compiled-kernel-cache.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

__all__ = ["PRIVATE_ENV", "checked_dir", "check_dir", "check_object", "record", "verified"]

log = logging.getLogger("fdx.ops.kernel_cache")

PRIVATE_ENV = "FDX_KERNEL_CACHE_PRIVATE"     # set by the process that rebuilt privately, for its children
KEY_FILE = ".key"                            # in a private folder: the build key it holds


def _strict_root(path: Path) -> Path:
    """Where the strict checks start: the given root, or the user's home for the default cache."""
    for env in ("FDX_CACHE_DIR", "XDG_CACHE_HOME"):
        if root := os.environ.get(env):
            root = Path(root).absolute()
            if path == root or root in path.parents:
                return root
    home = Path.home().absolute()
    return home if home in path.parents else path


def _owned(p: Path, st: os.stat_result, folder: bool) -> str | None:
    """Why ``p`` (its lstat ``st``) is not this user's own folder (``folder``)
    or regular file, writable by nobody else; None when it is."""
    if folder and stat.S_ISLNK(st.st_mode):
        return f"{p} is a symlink"
    if folder and not stat.S_ISDIR(st.st_mode):
        return f"{p} is not a directory"
    if not folder and not stat.S_ISREG(st.st_mode):
        return f"{p} is not a regular file"
    if st.st_uid != os.geteuid():
        return f"{p} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"{p} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_dir(path: Path, root: Path | None = None, create: bool = False) -> str | None:
    """Why ``path`` cannot be trusted to hold code fdx loads, or None. With
    ``create``, missing folders from ``root`` down are made with mode 0700."""
    path = Path(path).absolute()
    root = Path(root).absolute() if root is not None else _strict_root(path)
    for up in reversed(list(root.parents)):
        try:
            st = os.stat(up)
        except OSError as e:
            return f"{up}: {e.strerror}"
        if st.st_uid not in (0, os.geteuid()):
            return f"{up} (above the cache) is owned by uid {st.st_uid}, not by this user or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{up} (above the cache) is writable by group or others without the sticky bit"
    chain = [root] + [p for p in reversed(path.parents) if root in p.parents] + ([path] if path != root else [])
    home = Path.home().absolute()
    for p in chain:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            if not create:
                return f"{p} does not exist"
            try:
                os.mkdir(p, 0o700)
                st = os.lstat(p)
            except OSError as e:
                return f"cannot create {p}: {e.strerror}"
        except OSError as e:
            return f"{p}: {e.strerror}"
        if p == home and p == root:               # the home folder itself: only its owner matters
            if st.st_uid not in (0, os.geteuid()):
                return f"{p} is owned by uid {st.st_uid}"
            continue
        why = _owned(p, st, folder=True)
        if why:
            return why
    return None


def _sha256(path: Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_path(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _own_file(p: Path) -> str | None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return f"{p} does not exist"
    except OSError as e:
        return f"{p}: {e.strerror}"
    return _owned(p, st, folder=False)


def check_object(so: Path) -> str | None:
    """Why the built object ``so`` must not be loaded, or None: it and its
    record are this user's regular files and its sha256 matches the record."""
    so = Path(so)
    rec = _record_path(so)
    why = _own_file(so)
    if why:
        return why
    if _own_file(rec) is not None:
        return f"no record of its hash from fdx's build ({rec.name}): not built by this fdx, or the build did not finish"
    try:
        want = rec.read_text().split()[0] if rec.read_text().strip() else ""
        got = _sha256(so)
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    if got != want:
        return f"its sha256 does not match the record its build wrote ({rec.name}): it was changed after the build"
    return None


def record(so: Path) -> None:
    """Write the sha256 record of a freshly built object (atomically)."""
    so = Path(so)
    rec = _record_path(so)
    tmp = rec.with_name(f".{rec.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{_sha256(so)}  {so.name}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, rec)


def _private(key: str) -> Path | None:
    """This process tree's private build for ``key`` ($FDX_KERNEL_CACHE_PRIVATE), if it checks out."""
    where = os.environ.get(PRIVATE_ENV)
    if not where:
        return None
    p = Path(where)
    try:
        ok = check_dir(p, root=p) is None and (p / KEY_FILE).read_text().strip() == key
    except OSError:
        ok = False
    return p if ok else None


def checked_dir(path: Path) -> Path:
    """The folder to build in or load from for the cache folder ``path``:
    itself (created 0700 as needed) when it can be trusted, else a private
    one (warned, naming ``path`` and the reason)."""
    path = Path(path)
    why = check_dir(path, create=True)
    if why is None:
        return path
    reused = _private(path.name)
    if reused is not None:
        return reused
    fresh = Path(tempfile.mkdtemp(prefix=f"fdx-ops-{path.name}-"))      # mode 0700
    (fresh / KEY_FILE).write_text(path.name + "\n")
    os.environ[PRIVATE_ENV] = str(fresh)
    log.warning("fdx kernel cache: not loading anything from %s: %s. Building the kernels in a private "
                "folder, %s, instead (each start will, until the cache folder is fixed or FDX_CACHE_DIR "
                "points at a folder only this user can write; docs/security.md#the-compiled-kernel-cache)",
                path, why, fresh)
    return fresh


def verified(folder: Path, so: Path) -> bool:
    """Whether the cached object ``so`` (in the checked ``folder``) may be
    loaded; if not, it is removed (with its build folder) so that the
    rebuild cannot pick it up, and a warning names it and the reason."""
    why = check_object(so)
    if why is None:
        return True
    log.warning("fdx kernel cache: not loading %s: %s; rebuilding it", so, why)
    target = so.parent if so.parent != Path(folder) else so
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
    _record_path(so).unlink(missing_ok=True)
    return False
