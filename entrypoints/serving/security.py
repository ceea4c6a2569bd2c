"""Guards of ``fdx serve`` against hostile and careless clients (see
docs/security.md): where it may listen without a key, which endpoints need
the key, how many tokens one request may ask for, and how long a stream may
wait for a client that does not read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import ipaddress
import logging
import socket
import struct
import termios

from starlette.responses import StreamingResponse

from fdx.entrypoints.serving.protocol import APIError

log = logging.getLogger("fdx.server")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(sc) -> str | None:
    """A warning when the server listens beyond this machine with no API key."""
    if sc.api_key or is_loopback(sc.host):
        return None
    return (f"listening on {sc.host} with no API key: anyone who can reach this port can use the model "
            "(set --api-key or $FDX_API_KEY, or bind 127.0.0.1)")


API_DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")


def needs_key(sc, path: str) -> bool:
    """Paths the API key guards: /v1/..., /tokenize and /detokenize, the API's
    schema and its pages (/openapi.json, /docs, /redoc), and /health or
    /metrics when closed by config."""
    if path.startswith("/v1") or path in ("/tokenize", "/detokenize") or path in API_DOCS:
        return True
    if path == "/health":
        return sc.health_access == "key"
    if path == "/metrics":
        return sc.metrics_access == "key"
    return False


def check_token_budget(sp, prompt_lens: list[int], max_model_len: int, cap: int | None):
    """Refuse (400) what the context cannot hold, as vLLM does, and what the
    per-request cap forbids; an unset max_tokens (chat) gets what is left.
    Returns the SamplingParams to use."""
    longest = max(prompt_lens)
    num_seqs = sp.n * len(prompt_lens)
    if sp.max_tokens is not None:
        if longest + sp.max_tokens > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                           f"requested {longest + sp.max_tokens} tokens ({longest} in the prompt, "
                           f"{sp.max_tokens} in the completion). Please reduce the length of the prompt or "
                           "max_tokens.", param="max_tokens", code="context_length_exceeded")
        if cap is not None and sp.max_tokens * num_seqs > cap:
            raise APIError(400, f"the request asks for up to {sp.max_tokens * num_seqs} generated tokens "
                           f"(max_tokens {sp.max_tokens} x {num_seqs} completions); this server allows "
                           f"{cap} per request (max_tokens_per_request)", param="max_tokens",
                           code="max_tokens_per_request")
        return sp
    if cap is None:
        return sp
    share = cap // num_seqs
    if share < 1:
        raise APIError(400, f"{num_seqs} completions in one request exceed this server's "
                       f"max_tokens_per_request of {cap}", param="n", code="max_tokens_per_request")
    return dataclasses.replace(sp, max_tokens=min(share, max_model_len - longest))


class DrainClock:
    """How long a client has taken none of the data waiting for it, from the
    kernel's own counts: the bytes waiting in this socket's send queue
    (SIOCOUTQ) and in the transport's buffer, and the bytes the client's TCP
    has acknowledged (TCP_INFO ``tcpi_bytes_acked``). While data waits and
    the acknowledged count stands still, the clock runs; any progress, or
    nothing waiting, resets it. So the cut is measured from the moment the
    client stopped taking data, whatever the buffers on the way can hold.
    Linux only: ``DrainClock.of`` is None elsewhere."""

    TCP_INFO_BYTES_ACKED = 120                   # offset of the u64 in struct tcp_info (Linux 4.1+)

    def __init__(self, transport, fd: int):
        self.transport, self.fd = transport, fd
        self.acked = -1
        self.since = 0.0

    @classmethod
    def of(cls, scope) -> "DrainClock | None":
        transport = scope.get("fdx.transport")
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or not hasattr(socket, "TCP_INFO"):
            return None
        clock = cls(transport, sock.fileno())
        try:
            clock.sample()
        except (OSError, struct.error):
            return None
        return clock

    def sample(self) -> tuple[int, int]:
        """(bytes waiting to be taken, bytes the client has acknowledged)."""
        info = self.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        (acked,) = struct.unpack_from("Q", info, self.TCP_INFO_BYTES_ACKED)
        (queued,) = struct.unpack("i", fcntl.ioctl(self.fd, termios.TIOCOUTQ, b"\0\0\0\0"))
        return queued + self.transport.get_write_buffer_size(), acked

    def stalled_for(self, now: float) -> float:
        waiting, acked = self.sample()
        if not waiting or acked != self.acked:
            self.acked, self.since = acked, now
        return now - self.since


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a client which takes none of its
    data for ``send_timeout`` seconds (it stopped reading, or reads far too
    slowly). The clock starts when the client stops taking data (DrainClock),
    not when the buffers between it and the server are full: a watch every
    fraction of the timeout interrupts the stream wherever it waits (on the
    engine, or on a full socket). The connection is then reset, the stream's
    generator closed, which aborts its request in the engine and frees its KV
    blocks. Where the kernel's counts are not available, the timeout applies
    to each send that cannot proceed. Other requests never wait on it."""

    def __init__(self, *args, send_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.send_timeout = send_timeout
        self.clock: DrainClock | None = None

    async def __call__(self, scope, receive, send) -> None:
        self.clock = DrainClock.of(scope)
        self.request_id = scope.get("fdx.request_id")
        await super().__call__(scope, receive, send)

    def _watch(self, cut: asyncio.Timeout, period: float) -> None:
        loop = asyncio.get_running_loop()
        try:
            stalled = self.clock.stalled_for(loop.time())
        except (OSError, struct.error):          # the socket is gone: the stream ends on its own
            return
        if stalled >= self.send_timeout:
            cut.reschedule(loop.time())
        else:
            self._watcher = loop.call_later(period, self._watch, cut, period)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._watcher = None
        cut = asyncio.timeout(None)
        try:
            async with cut:
                if self.clock is not None:
                    self._watch(cut, min(1.0, self.send_timeout / 4))
                async for chunk in self.body_iterator:
                    if not isinstance(chunk, (bytes, memoryview)):
                        chunk = chunk.encode(self.charset)
                    if self.clock is None:           # no kernel counts: a deadline on each send
                        cut.reschedule(asyncio.get_running_loop().time() + self.send_timeout)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if self.clock is None:
                        cut.reschedule(None)
                if self._watcher is not None:
                    self._watcher.cancel()
                cut.reschedule(None)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            if not cut.expired():
                raise
            log.warning("request %s: its client took no stream data for %g s (stream_send_timeout_s): "
                        "it is aborted", self.request_id, self.send_timeout)
            if self.clock is not None:
                self.clock.transport.abort()     # drop what is buffered for it now, not after a flush
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
            await self.body_iterator.aclose()
