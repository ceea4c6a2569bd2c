"""Child processes, one way: the serving engine process
(entrypoints/serving/engine_proc.py, started by engine_client.py) and the tensor
parallel workers (plugins/backends/tp.py) are each started by ``spawn``
(``spawn_async`` in an event loop) as ``python -m <module> ... --parent-pid
<pid>`` (``child_command``) with their config as JSON on stdin, and each
begins with ``start_child``: it dies with its parent (``die_with_parent``),
ignores Ctrl-C (the parent stops it), and gives up at once when the parent
is already gone. While idle they poll ``orphaned``. The parent stops them
with ``stop`` (``stop_async``): the stop message it sent first, then
SIGTERM, then SIGKILL, each given its grace. It names a child that ended
with ``exit_message`` (while starting or serving) or ``death_message`` (a
death while serving, as the requests in flight read it).
Messages between them are tagged msgspec structs in msgpack, never pickle
(core/messages.py, tp.py's ``Worker*``): a decoder typed with their union
rejects anything else, and the first message back is the handshake
(``EngineReady`` / ``WorkerLoaded``) or the failure that replaces it.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping

from fdx.core.host import signal_name


def child_command(module: str, *args: str) -> list[str]:
    """The command line of a child running ``module``, told this process's pid."""
    return [sys.executable, "-m", module, *args, "--parent-pid", str(os.getpid())]


def spawn(module: str, *args: str, payload: bytes, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """Start ``module`` as a child (``child_command``) and hand it
    ``payload`` (its config, as JSON) on stdin, closed after."""
    proc = subprocess.Popen(child_command(module, *args), stdin=subprocess.PIPE, env=env)
    proc.stdin.write(payload)
    proc.stdin.close()
    return proc


async def spawn_async(module: str, *args: str, payload: bytes) -> asyncio.subprocess.Process:
    """``spawn`` from an event loop (an ``asyncio.subprocess.Process``)."""
    proc = await asyncio.create_subprocess_exec(*child_command(module, *args), stdin=asyncio.subprocess.PIPE)
    proc.stdin.write(payload)
    proc.stdin.close()
    return proc


def stop(procs: Iterable[subprocess.Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` in all for children already told to stop (by
    a message of their own), then kill the ones left and reap them."""
    procs = list(procs)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def stop_async(proc: asyncio.subprocess.Process, grace_s: float, asked: bool) -> None:
    """Stop one child from an event loop: when it was ``asked`` (sent its
    stop message) wait ``grace_s`` for it, then SIGTERM and wait as long,
    then SIGKILL; a child that reads no messages yet is sent SIGTERM at once."""
    actions = (None, proc.terminate, proc.kill) if asked else (proc.terminate, proc.kill)
    for action in actions:
        if proc.returncode is not None:
            return
        if action is not None:
            try:
                action()
            except ProcessLookupError:
                return
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
            return
        except asyncio.TimeoutError:
            continue


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies
    (Linux PR_SET_PDEATHSIG; elsewhere ``orphaned`` polling alone).
    SIGTERM lets a child end cleanly (the engine process flushes its KV
    connector and removes its sockets); a TP worker asks for SIGKILL, since
    a rank blocked in a collective would never run a handler."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, sig)                     # PR_SET_PDEATHSIG
        except OSError:
            pass


def orphaned(parent_pid: int | None) -> bool:
    """Whether the parent that started us (``--parent-pid``) is gone."""
    return parent_pid is not None and os.getppid() != parent_pid


def stacks_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` writes every thread's Python stack to this
    process's stderr (the server's log) and the process goes on: how a
    process that serves nothing but is alive (a step that never ends, a
    loop waiting on something) says where it is (docs/reliability.md)."""
    import faulthandler
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def start_child(parent_pid: int | None, sig: signal.Signals = signal.SIGTERM) -> bool:
    """What a child does first: die with its parent, leave Ctrl-C to it
    (the parent stops its children), say its stacks on SIGUSR1, and return
    False when the parent is already gone (the child then exits at once)."""
    die_with_parent(sig)
    stacks_on_sigusr1()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return not orphaned(parent_pid)


def exit_message(who: str, returncode: int, when: str) -> str:
    """How a child's end reads to a user: ``who`` "exited with status N"
    ``when``, or, for a negative status (killed by a signal), the signal by
    name; SIGILL with what it means and where to look."""
    if returncode >= 0:
        return f"{who} exited with status {returncode} {when} (see its messages above)"
    name = signal_name(returncode)
    if -returncode == signal.SIGILL:
        return (f"{who} was killed by SIGILL (status {returncode}) {when}: an illegal instruction, from a kernel "
                "built for an instruction set this CPU lacks (such as AVX-512); Paddle's C++ traceback above "
                "names the kernel, `fdx env` shows the CPU and its kernels, and docs/backends.md says what to "
                "turn off")
    return f"{who} was killed by {name} (status {returncode}) {when} (see its messages above)"


def death_message(who: str, returncode: int) -> str:
    """A death while serving, as a failed request reads it: '``who`` died
    (status N)', and the signal by name for a negative status."""
    if returncode is not None and returncode < 0:
        return f"{who} died (status {returncode}, {signal_name(returncode)})"
    return f"{who} died (status {returncode})"
