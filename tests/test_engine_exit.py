"""What the user reads when the engine process ends while loading."""
from __future__ import annotations

import asyncio
import signal
import sys

import pytest


def test_exit_message_names_the_signal_and_explains_sigill():
    from fdx.core.procs import exit_message
    assert exit_message("the engine process", 1, "while loading") == (
        "the engine process exited with status 1 while loading (see its messages above)")
    ill = exit_message("the engine process", -4, "while loading")
    assert ill.startswith("the engine process was killed by SIGILL (status -4) while loading: an illegal instruction")
    assert "instruction set this CPU lacks" in ill and "fdx env" in ill and "docs/backends.md" in ill
    assert exit_message("p", -int(signal.SIGKILL), "while loading") == (
        f"p was killed by SIGKILL (status -{int(signal.SIGKILL)}) while loading (see its messages above)")
    assert "SIGSEGV" in exit_message("p", -int(signal.SIGSEGV), "while loading")
    assert "illegal" not in exit_message("p", -int(signal.SIGSEGV), "while loading")
    assert exit_message("p", -200, "x") == "p was killed by signal 200 (status -200) x (see its messages above)"


@pytest.mark.slow
def test_an_engine_killed_by_sigill_while_loading_is_reported_by_name(tmp_path, monkeypatch):
    """A real child that dies by SIGILL after reading its config, in place
    of the engine process: EngineClient.start's error says SIGILL."""
    from fdx.core.config import FdxConfig
    from fdx.core.serving.engine_client import EngineClient, EngineDeadError
    child = tmp_path / "engine"
    child.write_text("#!/bin/sh\ncat > /dev/null\nkill -ILL $$\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    client = EngineClient(FdxConfig.build(None))

    async def go():
        try:
            await client.start()
        finally:
            await client.shutdown()
    with pytest.raises(EngineDeadError) as e:
        asyncio.run(go())
    assert client.proc.returncode == -signal.SIGILL
    assert str(e.value).startswith("the engine process was killed by SIGILL (status -4) while loading")
