"""The edge policy that ``fdx serve`` and ``fdx router`` share (docs/security.md).

Before anything reads a body: the API key (from the headers, constant-time)
and the body limit (Content-Length, then counted as it arrives). After the
schema (core/serving/protocol.py) has parsed it: the sizes a request may
carry (stop strings, bad words, logit_bias, guided constraints,
extra_args), so no field can make the engine do unbounded work or put a
number on the wire that msgpack cannot carry. Every refusal is an
OpenAI-shaped 4xx naming the field. Paddle-free: the API process and the
router import it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import secrets
import time
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fdx.core.serving import security
from fdx.core.serving.protocol import MAX_JSON_DEPTH, APIError, check_untrusted, error_body

INT64 = (-2**63, 2**63)


class BodyTooLarge(Exception):
    pass


# -- request ids and trace context (docs/serving.md#request-ids-and-tracing) -----------------

REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID = 128
REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=@~-]{1,%d}" % MAX_REQUEST_ID)
TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
MAX_TRACESTATE = 512                              # W3C: at most 32 members, 512 characters kept
TRACESTATE = re.compile(rb"[\x20-\x7e]{1,%d}" % MAX_TRACESTATE)
requests_log = logging.getLogger("fdx.requests")


def new_request_id() -> str:
    return secrets.token_hex(16)


def request_context(headers: dict[bytes, bytes]) -> tuple[str, str | None, dict[str, str]]:
    """(the request id: X-Request-Id, or a new one; why the header is bad,
    or None; the trace carrier to pass on: ``x-request-id``, and W3C
    ``traceparent`` / ``tracestate`` when well formed: a malformed one is
    dropped, as the W3C spec says, starting a new trace)."""
    raw, bad = headers.get(b"x-request-id"), None
    if raw is None:
        rid = new_request_id()
    elif REQUEST_ID.fullmatch(raw):
        rid = raw.decode()
    else:
        rid = new_request_id()
        bad = (f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID} characters of letters, digits "
               f"and ._:/+=@~- (got {len(raw)} bytes{': ' + repr(raw[:40].decode('latin-1')) if raw else ''})")
    carrier = {"x-request-id": rid}
    tp = headers.get(b"traceparent")
    if tp is not None and TRACEPARENT.fullmatch(tp) and tp[:2] != b"ff" and tp[3:35] != b"0" * 32 \
            and tp[36:52] != b"0" * 16:
        carrier["traceparent"] = tp.decode()
        ts = headers.get(b"tracestate")
        if ts is not None and TRACESTATE.fullmatch(ts):
            carrier["tracestate"] = ts.decode()
    return rid, bad, carrier


class GuardMiddleware:
    """The API key (on the paths ``security.needs_key`` names) and the body
    limit, both decided on the headers before any body byte is read. On
    /v1: the request id (X-Request-Id, checked, else made) and trace
    context, in ``scope["fdx.request_id"]`` / ``scope["fdx.trace"]``; the id
    echoed on every response and named in one ``fdx.requests`` log line
    when the response of a POST or of a refusal ends (with what the
    endpoint put in ``scope["fdx.log"]``)."""

    def __init__(self, app, sc):
        self.app = app
        self.key = sc.api_key.encode() if sc.api_key else None
        self.max_body = sc.max_request_body_bytes
        self.sc = sc

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not scope["path"].startswith("/v1"):
            return await self._guarded(scope, receive, send, headers, None)
        rid, bad, carrier = request_context(headers)
        scope["fdx.request_id"], scope["fdx.trace"], scope["fdx.log"] = rid, carrier, {}
        echo = (b"x-request-id", rid.encode())
        status, t0 = [None], time.monotonic()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), echo]}
            await send(message)
        try:
            await self._guarded(scope, receive, send_with_id, headers, bad)
        finally:       # a line per generation request and per refusal (not per poll of /v1/engine/stats)
            if (scope.get("method") != "GET" or (status[0] or 500) >= 400) and requests_log.isEnabledFor(logging.INFO):
                detail = scope["fdx.log"].get("detail")
                requests_log.info("request %s: %s %s %s in %.3f s%s", rid, scope.get("method"), scope["path"],
                                  status[0] or "(no response)", time.monotonic() - t0,
                                  f", {detail}" if detail else "")

    async def _guarded(self, scope, receive, send, headers, bad_request_id):
        if self.key is not None and security.needs_key(self.sc, scope["path"]):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                return await send_json(send, 401, error_body(
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key"))
        if bad_request_id is not None:
            return await send_json(send, 400, error_body(bad_request_id, param=REQUEST_ID_HEADER,
                                                         code="invalid_request_id"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await send_json(send, 413, error_body(
                f"the request body is {int(length)} bytes; the limit is {self.max_body}",
                code="request_too_large"))
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge()
            return message
        return await self.app(scope, limited_receive, send)


async def send_json(send, status: int, body: dict) -> None:
    raw = JSONResponse(body).body                 # the same bytes as every other error body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": raw})


def validation_error(errs: list[dict]) -> JSONResponse:
    """A pydantic validation failure as a 400 naming the first bad field."""
    if any(er.get("type") == "json_invalid" or tuple(er.get("loc", ())) == ("body",) for er in errs):
        return JSONResponse(error_body("the request body is not a valid JSON object"), status_code=400)
    def where(er: dict) -> str:                   # no "body", no union member labels ("list[int]")
        return ".".join(str(p) for p in er.get("loc", ()) if p != "body" and not (
            isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "dict", "list"))))
    param = (where(errs[0]) if errs else None) or None
    msg = "; ".join(f"{where(er) or 'body'}: {er.get('msg')}" for er in errs[:5])
    return JSONResponse(error_body(f"invalid request: {msg}", param=param), status_code=400)


def install(app, sc) -> None:
    """The guard and the error handlers: every refusal in OpenAI's shape."""
    app.add_middleware(GuardMiddleware, sc=sc)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        return validation_error(e.errors())

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_, e):
        return JSONResponse(error_body(f"the request body exceeds {sc.max_request_body_bytes} bytes",
                                       code="request_too_large"), status_code=413)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if isinstance(e.__cause__, BodyTooLarge):           # FastAPI wraps what reading the body raised
            return await _too_large(None, e.__cause__)
        detail = str(e.detail)
        if detail == "There was an error parsing the body":   # FastAPI's words for bad UTF-8, deep nesting
            detail = "the request body could not be parsed as JSON (it must be UTF-8 and not absurdly nested)"
        return JSONResponse(error_body(detail, kind), status_code=e.status_code)


def parse_json(raw: bytes) -> Any:
    """A request body as JSON, or a 400 (bad UTF-8, bad JSON, absurd nesting)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request nests deeper than {MAX_JSON_DEPTH} levels",
                       param=_deep_field(raw)) from None
    except ValueError:
        raise APIError(400, "the request body is not valid JSON (it must be UTF-8)") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body is not a valid JSON object")
    check_untrusted(data)
    return data


def _deep_field(raw: bytes) -> str | None:
    """The top-level key whose value nests past MAX_JSON_DEPTH (a scan, no parser)."""
    depth, in_str, esc, start, key = 0, False, False, 0, None
    for i, ch in enumerate(raw):
        if in_str:
            if esc:
                esc = False
            elif ch == 0x5C:                      # backslash
                esc = True
            elif ch == 0x22:                      # the closing quote
                in_str = False
                if depth == 1:
                    key = raw[start:i].decode("utf-8", "replace")
        elif ch == 0x22:
            in_str, start = True, i + 1
        elif ch in b"[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return key
        elif ch in b"]}":
            depth -= 1
    return None


# -- what one request may carry ----------------------------------------------------

def _json_size(value: Any) -> int:
    return len(value) if isinstance(value, str) else len(json.dumps(value, ensure_ascii=False))


def check_wire_values(value: Any, param: str) -> None:
    """Only what msgpack carries: integers within 64 bits, anywhere inside."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool) or v is None or isinstance(v, (str, float)):
            continue
        if isinstance(v, int):
            if not INT64[0] <= v < INT64[1]:
                raise APIError(400, f"{param} holds the integer {str(v)[:40]}, outside the 64-bit range",
                               param=param)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def check_limits(req, sc, vocab_size: int | None = None) -> None:
    """Refuse (400, naming the field) what is past this server's per-request
    limits (server.max_* in core/config.py, documented in docs/serving.md)."""
    def refuse(param: str, why: str):
        raise APIError(400, f"{param}: {why}", param=param, code="limit_exceeded")

    stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stop) > sc.max_stop_strings:
        refuse("stop", f"at most {sc.max_stop_strings} stop strings, got {len(stop)}")
    if any(len(s) > sc.max_stop_string_chars for s in stop):
        refuse("stop", f"each stop string at most {sc.max_stop_string_chars} characters")
    words = req.bad_words or []
    if len(words) > sc.max_bad_words:
        refuse("bad_words", f"at most {sc.max_bad_words} words, got {len(words)}")
    total = sum(len(w.encode("utf-8")) for w in words)
    if total > sc.max_bad_words_bytes:
        refuse("bad_words", f"at most {sc.max_bad_words_bytes} bytes of words in all, got {total}")
    top = vocab_size if vocab_size else 2**31
    bias = req.logit_bias or {}
    if len(bias) > sc.max_logit_bias:
        refuse("logit_bias", f"at most {sc.max_logit_bias} entries, got {len(bias)}")
    for k in bias:
        if not (k.isascii() and k.isdigit() and len(k) <= 10 and int(k) < top):
            refuse("logit_bias", f"keys must be token ids in [0, {top}), got {k[:40]!r}")
    allowed = req.allowed_token_ids
    if allowed is not None:
        most = min(sc.max_allowed_token_ids, vocab_size or sc.max_allowed_token_ids)   # more repeat ids
        if len(allowed) > most:
            refuse("allowed_token_ids", f"at most {most} token ids, got {len(allowed)}")
        if any(t >= top for t in allowed):
            refuse("allowed_token_ids", f"token ids must be in [0, {top})")
    if vocab_size and any(t >= vocab_size for t in req.stop_token_ids or []):
        refuse("stop_token_ids", f"token ids must be in [0, {vocab_size})")
    for name in ("guided_json", "guided_regex", "guided_grammar", "structural_tag", "response_format", "tools"):
        value = getattr(req, name, None)          # tools: chat only (required / named compile them)
        if value is not None and _json_size(value) > sc.max_guided_bytes:
            refuse(name, f"at most {sc.max_guided_bytes} characters")
    choices = req.guided_choice
    if choices is not None:
        if len(choices) > sc.max_guided_choices:
            refuse("guided_choice", f"at most {sc.max_guided_choices} choices, got {len(choices)}")
        if sum(map(len, choices)) > sc.max_guided_bytes:
            refuse("guided_choice", f"at most {sc.max_guided_bytes} characters of choices in all")
    for name in ("extra_args", "vllm_xargs"):
        value = getattr(req, name)
        if value is None:
            continue
        check_wire_values(value, name)
        if _json_size(value) > sc.max_extra_args_bytes:
            refuse(name, f"at most {sc.max_extra_args_bytes} bytes (as JSON)")


# -- connections: a cap below the file-descriptor limit, and no log flood -------------

MAX_LINGERING = 16         # refused connections kept open (up to 1 s) so their client reads the 503
FD_RESERVE = 64            # descriptors kept for everything but client connections (engine pipes, files)
_REFUSAL = json.dumps(error_body("too many open connections; retry later", "service_unavailable",
                                 code="too_many_connections")).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: "
           + str(len(_REFUSAL)).encode() + b"\r\nconnection: close\r\nretry-after: 1\r\n\r\n" + _REFUSAL)


def connection_cap(configured: int | None) -> int:
    """Open client connections allowed: ``configured``, and never more than
    the descriptor limit (raised to its hard limit first) leaves after
    FD_RESERVE, so accept() never runs out of descriptors."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    room = max(1, soft - FD_RESERVE) if soft != resource.RLIM_INFINITY else 1 << 20
    return min(configured, room) if configured else room


HEAD_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")


def capped_http_protocol(max_connections: int, header_timeout_s: float | None = None,
                         send_buffer_bytes: int | None = None):
    """uvicorn's h11 protocol with three bounds uvicorn does not have:

    - past ``max_connections``, a connection is answered with a 503
      (OpenAI-shaped, ``code: too_many_connections``) and closed once its
      request head has arrived, or after a second;
    - a request head (the request line and headers) must be complete within
      ``header_timeout_s`` of the connection, or of its first byte on a
      kept-alive connection: a client that trickles headers gets a 408 and
      is closed (h11 itself waits forever);
    - the socket's kernel send buffer is ``send_buffer_bytes`` (else Linux
      grows it to megabytes for a client that stops reading), and each
      request's scope carries its transport under ``"fdx.transport"``, so a
      stream can tell when its client stopped taking data
      (security.TimedStreamingResponse)."""
    import socket

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class CappedH11Protocol(H11Protocol):
        refused = False
        lingering = 0                             # refused connections waiting for their head
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            if len(self.connections) < max_connections:
                super().connection_made(transport)
                sock = transport.get_extra_info("socket")
                if send_buffer_bytes and sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
                self._arm_head_timer()
                return
            self.refused, self.transport = True, transport
            refusals.warning("refusing connections past server.max_connections=%d (503)", max_connections)
            transport.write(REFUSAL)
            if CappedH11Protocol.lingering >= MAX_LINGERING:    # a flood: no descriptor held for it
                self._closer = None
                transport.close()
                return
            CappedH11Protocol.lingering += 1
            self._closer = asyncio.get_running_loop().call_later(1.0, transport.close)

        def _arm_head_timer(self) -> None:
            if header_timeout_s and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                refusals.warning("closing connections whose request head was not complete within "
                                 "%g s (server.header_timeout_s; 408)", header_timeout_s)
                self.transport.write(HEAD_TIMEOUT)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if not self.refused:
                if self.conn.their_state is h11.IDLE:    # a head begins (or goes on): its clock runs
                    self._arm_head_timer()
                super().data_received(data)
                if self.conn.their_state is not h11.IDLE:
                    self._disarm_head_timer()
                return
            if b"\r\n\r\n" in data:               # the head is read: closing now sends no reset
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None:
                self.cycle.scope["fdx.transport"] = self.transport

        def connection_lost(self, exc) -> None:
            if not self.refused:
                self._disarm_head_timer()
                return super().connection_lost(exc)
            if self._closer is not None:
                self._closer.cancel()
                CappedH11Protocol.lingering -= 1

        def pause_writing(self) -> None:
            if not self.refused:
                super().pause_writing()

        def resume_writing(self) -> None:
            if not self.refused:
                super().resume_writing()

    return CappedH11Protocol


class RateLimitFilter(logging.Filter):
    """Let through at most one record per ``period`` seconds (per logger it
    guards); the next one says how many were held back. For messages that
    would otherwise repeat thousands of times a second (a refused
    connection, accept() out of descriptors)."""

    def __init__(self, period: float = 10.0, only: tuple[str, ...] = ()):
        super().__init__()
        self.period, self.only = period, only
        self.last, self.dropped = -float("inf"), 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.only and not any(s in str(record.msg) for s in self.only):
            return True
        now = time.monotonic()
        if now - self.last < self.period:
            self.dropped += 1
            return False
        if self.dropped:
            record.msg = f"{record.msg} ({self.dropped} more like it in the last {self.period:g} s not logged)"
            self.dropped = 0
        self.last = now
        if record.exc_info and "out of system resource" in str(record.msg):
            record.exc_info, record.exc_text = None, None   # one line, not a traceback each time
            record.msg = f"{record.msg}: too many open files (raise the descriptor limit or server.max_connections)"
        return True


refusals = logging.getLogger("fdx.connections")
refusals.addFilter(RateLimitFilter())


def quiet_accept_errors() -> None:
    """asyncio logs a traceback each time accept() finds no descriptor left:
    at most one line per 10 s instead (idempotent)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, RateLimitFilter) for f in log.filters):
        log.addFilter(RateLimitFilter(only=("out of system resource",)))
