"""What the user reads when the engine process ends while loading."""
from __future__ import annotations

import asyncio
import signal
import sys
import time

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
    from fdx.entrypoints.serving.engine_client import EngineClient, EngineDeadError
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


def test_death_message_names_the_signal():
    from fdx.core.procs import death_message
    assert death_message("the engine process", 1) == "the engine process died (status 1)"
    assert death_message("the engine process", -int(signal.SIGKILL)) == (
        f"the engine process died (status -{int(signal.SIGKILL)}, SIGKILL)")


def test_spawn_hands_the_payload_and_stop_kills_a_child_that_ignores_its_stop(tmp_path, monkeypatch):
    """A real child (a shell script in place of Python) that keeps its
    payload and its command line, then never exits (as a child that
    missed its stop message): procs.stop kills and reaps it once the grace
    is over."""
    from fdx.core import procs
    child = tmp_path / "child"
    child.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/args\ncat > {tmp_path}/payload\n"
                     f"touch {tmp_path}/ready\nwhile true; do sleep 1; done\n")
    child.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(child))
    proc = procs.spawn("some.module", "--x", "1", payload=b'{"a": 1}')
    while not (tmp_path / "ready").exists():          # the child has read all of stdin
        assert proc.poll() is None
        time.sleep(0.01)
    procs.stop([proc], grace_s=0.1)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "payload").read_bytes() == b'{"a": 1}'
    import os
    assert (tmp_path / "args").read_text().split() == ["-m", "some.module", "--x", "1", "--parent-pid",
                                                      str(os.getpid())]


def test_a_failing_output_callback_does_not_stop_the_reader(tmp_path):
    """The API process's reader of engine messages, over real ZMQ sockets:
    a callback that raises (one request's delivery failing) is logged, the
    other request of the same step still gets its delta, and later
    messages (a heartbeat, the next step) are still read. Before, the
    exception ended the reader task: every stream then waited forever while
    the watchdog, seeing messages queued, took the engine for alive."""
    import zmq
    import zmq.asyncio

    from fdx.core.config import FdxConfig
    from fdx.core.messages import EngineHeartbeat, EngineOutputs, EngineStats, SeqDelta
    from fdx.core.messages import encoder
    from fdx.entrypoints.serving.engine_client import EngineClient

    client = EngineClient(FdxConfig.build(None))
    addr = f"ipc://{tmp_path}/out"
    got: list[tuple[str, list[int]]] = []

    def broken(delta):
        raise RuntimeError("a callback that fails")

    async def go():
        ctx = zmq.asyncio.Context()
        client._pull = ctx.socket(zmq.PULL)
        client._pull.bind(addr)
        import msgspec

        from fdx.core.messages import FromEngine
        client._decoder = msgspec.msgpack.Decoder(FromEngine)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        client.callbacks = {"a": broken, "b": lambda d: got.append((d.request_id, d.token_ids))}
        reader = asyncio.ensure_future(client._read_outputs())
        stats = EngineStats(1, 0, 0.0, 10, 10)
        await push.send(encoder.encode(EngineOutputs([SeqDelta("a", [1]), SeqDelta("b", [2])], stats)))
        await push.send(encoder.encode(EngineHeartbeat(False, 0.0, 123)))
        await push.send(encoder.encode(EngineOutputs([SeqDelta("b", [3], "length")], stats)))
        deadline = time.monotonic() + 30
        while (len(got) < 2 or client.last_beat is None) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not reader.done()
        reader.cancel()
        push.close(linger=0)
        client._pull.close(linger=0)
        ctx.term()

    asyncio.run(go())
    assert got == [("b", [2]), ("b", [3])]
    assert client.last_beat is not None and client.last_beat.resident_bytes == 123
    assert "b" not in client.callbacks and "a" in client.callbacks
