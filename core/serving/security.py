"""Guards of ``fdx serve`` against hostile and careless clients (see
docs/security.md): where it may listen without a key, which endpoints need
the key, how many tokens one request may ask for, and how long a stream may
wait for a client that does not read.
"""
from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging

from starlette.responses import StreamingResponse

from fdx.core.serving.protocol import APIError

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


def needs_key(sc, path: str) -> bool:
    """Paths the API key guards: /v1/..., and /health or /metrics when closed by config."""
    if path.startswith("/v1"):
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


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a client which accepts no data
    for ``send_timeout`` seconds (it never reads, or reads far too slowly).
    The stream's generator is closed, which aborts its request in the engine
    and frees its KV blocks; what is already buffered for that socket is
    bounded by the server's write buffer. Other requests never wait on it."""

    def __init__(self, *args, send_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.send_timeout = send_timeout

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, (bytes, memoryview)):
                    chunk = chunk.encode(self.charset)
                try:
                    async with asyncio.timeout(self.send_timeout):    # no task per chunk, unlike wait_for
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except TimeoutError:
                    log.warning("a client took no stream data for %g s (stream_send_timeout_s): "
                                "its request is aborted", self.send_timeout)
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()
