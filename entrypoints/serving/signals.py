"""A uvicorn server that a SIGTERM or Ctrl-C stops with exit status 0."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn's server, except that a SIGTERM or SIGINT is a clean stop.
    uvicorn raises the signal again once it has shut down, so the process
    dies of it (status 143 or 130); this one does not, and the command
    returns 0. ``on_signal`` runs first, in the event loop (``fdx serve``
    ends its streams there, so the graceful shutdown is quick); a second
    Ctrl-C forces the exit."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_signal = on_signal
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame) -> None:
        if self.on_signal is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_signal)
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
