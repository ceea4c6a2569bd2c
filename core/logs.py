"""The one log format of every fdx process: the CLI, the engine process,
tensor-parallel workers, the router, uvicorn's own lines, and the Python
API (``LLM``). Each line starts with its time:

    2026-12-03 19:20:58,350 INFO fdx.backends.cpu: kernels: ...

Entry points call ``configure(level)``. ``LLM`` calls ``configure_api()``,
which leaves logging alone when the program configured it (a handler on
the root logger other than the one Paddle installs on import, or one on
the ``fdx`` logger): fdx's records then go where the program sends them.
"""
from __future__ import annotations

import logging
import os

__all__ = ["FORMAT", "configure", "configure_api"]

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Paddle's import calls logging.basicConfig with this format (paddle/base/log_helper.py)
_PADDLE_FORMAT = "[%(asctime)-15s] [%(levelname)8s] %(filename)s:%(lineno)s - %(message)s"


def _handler(tag: str = "") -> logging.Handler:
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter(FORMAT.replace("%(name)s", f"%(name)s{tag}")))
    h._fdx = True                                   # type: ignore[attr-defined]
    return h


def configure(level: str | int | None = None, tag: str = "") -> None:
    """An entry point's logging: fdx's lines through one handler in FORMAT
    (``tag`` follows the logger name, e.g. ``[tp1]``), at ``level``; other
    libraries' warnings through the root logger in the same format; and
    uvicorn's lines too when uvicorn is started later in this process."""
    fdx = logging.getLogger("fdx")
    for h in [h for h in fdx.handlers if getattr(h, "_fdx", False)]:
        fdx.removeHandler(h)
    fdx.addHandler(_handler(tag))
    fdx.propagate = False
    if level is not None:
        fdx.setLevel(level.upper() if isinstance(level, str) else level)
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(_handler(tag))
        root.setLevel(logging.WARNING)
    else:
        for h in root.handlers:
            if isinstance(h, logging.StreamHandler) and (h.formatter is None or h.formatter._fmt == _PADDLE_FORMAT):
                h.setFormatter(logging.Formatter(FORMAT))
    _uvicorn_format()


def configure_api() -> None:
    """The Python API's logging: as ``configure`` (at $FDX_LOG_LEVEL, else
    info) unless the program configured logging itself."""
    fdx = logging.getLogger("fdx")
    if any(getattr(h, "_fdx", False) for h in fdx.handlers):
        return                                      # configured already (an entry point, or an earlier LLM)
    own = [h for h in logging.getLogger().handlers
           if not (isinstance(h, logging.StreamHandler) and h.formatter is not None
                   and h.formatter._fmt == _PADDLE_FORMAT)]
    if fdx.handlers or own:
        return
    configure(None if fdx.level else os.environ.get("FDX_LOG_LEVEL", "INFO"))


def _uvicorn_format() -> None:
    """uvicorn configures its loggers from uvicorn.config.LOGGING_CONFIG when
    a server is made: its two formatters get the time and the logger name."""
    try:
        from uvicorn.config import LOGGING_CONFIG
    except ImportError:
        return
    fmts = LOGGING_CONFIG.get("formatters", {})
    if "default" in fmts:
        fmts["default"]["fmt"] = FORMAT
        fmts["default"]["use_colors"] = False
    if "access" in fmts:
        fmts["access"]["fmt"] = '%(asctime)s %(levelname)s %(name)s: %(client_addr)s - "%(request_line)s" %(status_code)s'
        fmts["access"]["use_colors"] = False
