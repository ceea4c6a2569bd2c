"""The edge policy that ``fdx serve`` and ``fdx router`` share (docs/security.md).

Before anything reads a body: the API key (from the headers, constant-time)
and the body limit (Content-Length, then counted as it arrives). After the
schema (entrypoints/serving/protocol.py) has parsed it: the sizes a request may
carry (stop strings, bad words, logit_bias, guided constraints,
extra_args), so no field can make the engine do unbounded work or put a
number on the wire that msgpack cannot carry. Every refusal is an
OpenAI-shaped 4xx naming the field. Paddle-free: the API process and the
router import it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import time
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fdx.entrypoints.serving import security
from fdx.entrypoints.serving.protocol import MAX_JSON_DEPTH, APIError, check_untrusted, error_body

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


API_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")   # beside /v1: request ids, refusal budget, reasons logged


def is_api_path(path: str) -> bool:
    return path.startswith("/v1") or path in API_PATHS


class RefusalBudget:
    """A per-client token bucket of refused request bytes: each 4xx (but
    429) costs the bytes of the body it refused (at least ``MIN_COST``);
    the bucket refills at ``rate`` bytes a second up to ``burst``. A client
    whose bucket is empty gets 429 ``too_many_refusals`` on its next
    requests, decided on the headers, until it has refilled: a client that
    repeats bodies the server refuses cannot keep its parser busy (issue 35
    item 4). Keyed by the client's address and the API key it presents
    (not by the key alone: one server key is often shared by every client,
    and one client's refusals must not lock out the others)."""

    MIN_COST = 1024
    MAX_KEYS = 10000

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.buckets: dict[tuple, tuple[float, float]] = {}     # key -> (level, when)

    def _level(self, key, now: float) -> float:
        level, when = self.buckets.get(key, (self.burst, now))
        return min(self.burst, level + (now - when) * self.rate)

    def wait_s(self, key, now: float | None = None) -> float:
        """0 when ``key`` may send; else the seconds until its bucket is positive."""
        now = time.monotonic() if now is None else now
        level = self._level(key, now)
        return 0.0 if level > 0 else (-level + 1) / self.rate

    def charge(self, key, cost: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.buckets[key] = (self._level(key, now) - max(cost, self.MIN_COST), now)
        if len(self.buckets) > self.MAX_KEYS:    # forget the clients that have refilled
            self.buckets = {k: v for k, v in self.buckets.items() if self._level(k, now) < self.burst}


async def drain_refused(receive, headers: dict, limit: int) -> None:
    """Before a refusal decided without the body: read and drop it unless its
    declared length is past ``limit``. Closing a connection with its bytes
    unread makes the kernel send a reset, which can take the refusal with it;
    a body declared longer is not read (the refusal goes out, the connection
    closes)."""
    length = headers.get(b"content-length", b"0")
    if not length.isdigit() or int(length) <= limit:
        await drain(receive, limit)


async def drain(receive, limit: int) -> bool:
    """Read and drop a request body (at most ``limit`` bytes), so the client,
    still sending, reads the answer instead of a reset. False: the body is
    longer than ``limit`` (or the client went away): close without reading on."""
    seen = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        seen += len(message.get("body", b""))
        if seen > limit:
            return False
        if not message.get("more_body", False):
            return True


class GuardMiddleware:
    """The API key (on the paths ``security.needs_key`` names) and the body
    limit, both decided on the headers before any body byte is read. On
    /v1, /tokenize and /detokenize: the request id (X-Request-Id, checked,
    else made) and trace context, in ``scope["fdx.request_id"]`` /
    ``scope["fdx.trace"]``; the id echoed on every response and named in
    one ``fdx.requests`` log line when the response of a POST or of a
    refusal ends (with what the endpoint put in ``scope["fdx.log"]``, and
    for a 4xx/5xx its reason); the refusal budget (RefusalBudget) per
    client."""

    def __init__(self, app, sc):
        self.app = app
        self.key = sc.api_key.encode() if sc.api_key else None
        self.max_body = sc.max_request_body_bytes
        self.sc = sc
        rate = getattr(sc, "refused_bytes_per_s", None)
        self.budget = RefusalBudget(rate, sc.refused_bytes_burst) if rate else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not is_api_path(scope["path"]):
            return await self._guarded(scope, receive, send, headers, None)
        rid, bad, carrier = request_context(headers)
        scope["fdx.request_id"], scope["fdx.trace"], scope["fdx.log"] = rid, carrier, {}
        echo = (b"x-request-id", rid.encode())
        status, reason, t0 = [None], [None], time.monotonic()
        client = (scope.get("client") or ("?", 0))[0]
        auth = headers.get(b"authorization", b"")
        who = (client, hashlib.sha256(auth).hexdigest()[:16] if auth else None)
        seen = [0]

        async def counted_receive():
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
            return message

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), echo]}
            elif message["type"] == "http.response.body" and reason[0] is None and (status[0] or 0) >= 400:
                reason[0] = _error_reason(message.get("body", b""))
            await send(message)
        try:
            wait = self.budget.wait_s(who) if self.budget is not None else 0.0
            if wait:
                await drain_refused(receive, headers, DRAIN_FACTOR * self.max_body)
                await send_json(send_with_id, 429, error_body(
                    f"too many refused requests from this client ({client}); retry in {math.ceil(wait)} s "
                    "(server.refused_bytes_per_s)", "rate_limit_error", code="too_many_refusals"),
                    extra_headers=[(b"retry-after", str(math.ceil(wait)).encode())])
                return
            await self._guarded(scope, counted_receive, send_with_id, headers, bad)
        finally:       # a line per generation request and per refusal (not per poll of /v1/engine/stats)
            code = status[0] or 500
            if self.budget is not None and 400 <= code < 500 and code != 429:
                # the body bytes it made this server read and parse
                self.budget.charge(who, 0 if scope.get("fdx.unparsed") else seen[0])
            if (scope.get("method") != "GET" or code >= 400) and requests_log.isEnabledFor(logging.INFO):
                detail = scope["fdx.log"].get("detail")
                requests_log.info("request %s: %s %s %s in %.3f s%s%s", rid, scope.get("method"), scope["path"],
                                  status[0] or "(no response)", time.monotonic() - t0,
                                  f", {detail}" if detail else "", f": {reason[0]}" if reason[0] else "")

    async def _guarded(self, scope, receive, send, headers, bad_request_id):
        if self.key is not None and security.needs_key(self.sc, scope["path"]):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):     # (no body byte read for a stranger)
                return await send_json(send, 401, error_body(
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    "authentication_error", code="invalid_api_key"))
        if bad_request_id is not None:
            await drain_refused(receive, headers, self.max_body)    # (a small one: see drain_refused)
            return await send_json(send, 400, error_body(bad_request_id, param=REQUEST_ID_HEADER,
                                                         code="invalid_request_id"))
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            # read and drop a body up to DRAIN_FACTOR x the limit, so its client reads the 413 (an 8 MB
            # body was answered by a reset); a larger one is answered at once and the connection closed
            scope["fdx.unparsed"] = True          # the refusal budget charges its minimum only
            await drain_refused(receive, headers, DRAIN_FACTOR * self.max_body)
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


DRAIN_FACTOR = 4          # a refused body up to this many times the body limit is read (and dropped) first


def _error_reason(raw: bytes) -> str | None:
    """An error body's message (and param), for the request's log line."""
    try:
        err = json.loads(raw)["error"]
        text = str(err["message"])
    except (ValueError, KeyError, TypeError):
        return None
    text = text if len(text) <= 300 else text[:300] + "..."
    return f"{text} (param {err['param']})" if err.get("param") else text


async def send_json(send, status: int, body: dict, extra_headers: list | None = None) -> None:
    raw = JSONResponse(body).body                 # the same bytes as every other error body
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close"), *(extra_headers or ())]})
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
    async def _http(request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if isinstance(e.__cause__, BodyTooLarge):           # FastAPI wraps what reading the body raised
            return await _too_large(None, e.__cause__)
        detail = str(e.detail)
        path = request.url.path
        if e.status_code in (404, 405) and detail in ("Not Found", "Method Not Allowed"):
            detail = f"{detail}: {request.method} {path[:200]}"
            if path.endswith("/") and len(path) > 1:      # no redirect to the path without it (app.py)
                detail += f" (without the trailing slash: {path.rstrip('/')[:200]})"
        if detail == "There was an error parsing the body":   # FastAPI's words for bad UTF-8, deep nesting
            detail = "the request body could not be parsed as JSON (it must be UTF-8 and not absurdly nested)"
        return JSONResponse(error_body(detail, kind), status_code=e.status_code)


def parse_json(raw: bytes, content_type: str | None = None, check: bool = True) -> Any:
    """A request body as JSON, or a 400 (bad UTF-8, bad JSON, absurd nesting).
    Whatever the Content-Type (curl's ``-d`` sends form-urlencoded): a body
    that parses as a JSON object is taken (docs/serving.md); one that does
    not is refused naming the content type it came with. ``check``: walk
    it for lone surrogates, depth and integer range (check_untrusted) here;
    False when a schema's validator does it next."""
    sent_as = "" if content_type is None or "json" in content_type.lower() else \
        f" (it was sent as Content-Type: {content_type[:80]}; fdx reads every body as JSON)"
    try:
        data = json.loads(raw)
    except RecursionError:
        raise APIError(400, f"the request nests deeper than {MAX_JSON_DEPTH} levels",
                       param=_deep_field(raw)) from None
    except ValueError:
        raise APIError(400, f"the request body is not valid JSON (it must be UTF-8){sent_as}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body is not a valid JSON object{sent_as}")
    if check:
        check_untrusted(data)
    return data


PARSE_ON_LOOP_BYTES = 32 * 1024      # larger bodies are parsed and validated in a thread


def checked_request(raw: bytes, schema, sc, content_type: str | None = None, with_data: bool = False):
    """Parse, size-check (check_sizes: before the schema, so an oversized
    field costs a count, not a validation) and validate one request body:
    the request (``with_data``: and the parsed dict). Raises APIError or
    RequestValidationError (both answered as a 400)."""
    from pydantic import ValidationError
    data = parse_json(raw, content_type, check=False)
    check_sizes(data, sc)
    try:
        req = schema.model_validate(data)           # its "before" validator runs check_untrusted
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from None
    return (req, data) if with_data else req


async def read_body(request) -> bytes:
    """The whole body; a client that leaves first (or is cut by
    server.body_timeout_s) ends the request as a 400 nobody reads, not as a
    traceback in the log."""
    from starlette.requests import ClientDisconnect
    try:
        return await request.body()
    except ClientDisconnect:
        raise APIError(400, "the client closed the connection before its request body was complete",
                       code="client_disconnected") from None


async def read_request(request, schema, sc, with_data: bool = False):
    """The request's body as ``schema``, checked. A body over
    PARSE_ON_LOOP_BYTES is parsed and validated in a worker thread, off the
    event loop that streams every other request's tokens (a 3 MB refused
    body held every stream for over a second there: issue 35 item 4). The
    thread still takes the GIL, but in 5 ms slices the loop shares, and
    check_sizes refuses an oversized field before the schema's validation
    (one call into pydantic-core that holds the GIL throughout) runs."""
    raw = await read_body(request)
    ctype = request.headers.get("content-type")
    request.scope["fdx.body_bytes"] = len(raw)
    if len(raw) <= PARSE_ON_LOOP_BYTES:
        return checked_request(raw, schema, sc, ctype, with_data)
    return await asyncio.to_thread(checked_request, raw, schema, sc, ctype, with_data)


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


def _size_over(value: Any, limit: int) -> int | None:
    """A lower bound of the JSON size of ``value`` (check_limits measures it
    exactly, later), or None when under ``limit``: stops counting once
    past it, so a 3 MB value costs no more than ``limit`` to measure."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2
        elif isinstance(v, dict):
            total += 2 + 2 * len(v)
            for k, x in v.items():
                total += len(k) if isinstance(k, str) else 1
                stack.append(x)
        elif isinstance(v, list):
            total += 2 + len(v)
            stack.extend(v)
        else:
            total += 1                           # a number, true, false, null: at least a character
        if total > limit:
            return total
    return None


def check_sizes(data: dict, sc) -> None:
    """The per-field limits of check_limits, on the body as parsed, before
    the schema validates it (docs/serving.md#what-one-request-may-carry):
    counts and sizes only, on whatever type the field holds (the schema
    then refuses a wrong type). 400 ``limit_exceeded`` naming the field."""
    def refuse(param: str, why: str):
        raise APIError(400, f"{param}: {why}", param=param, code="limit_exceeded")

    def count(name: str, most: int, what: str) -> None:
        v = data.get(name)
        if isinstance(v, (list, dict)) and len(v) > most:
            refuse(name, f"at most {most} {what}, got {len(v)}")

    count("stop", sc.max_stop_strings, "stop strings")
    count("bad_words", sc.max_bad_words, "words")
    count("logit_bias", sc.max_logit_bias, "entries")
    count("allowed_token_ids", sc.max_allowed_token_ids, "token ids")
    count("guided_choice", sc.max_guided_choices, "choices")
    count("messages", sc.max_messages, "messages")
    count("tools", sc.max_tools, "tools")
    stop = data.get("stop")
    if isinstance(stop, list) and any(isinstance(x, str) and len(x) > sc.max_stop_string_chars for x in stop):
        refuse("stop", f"each stop string at most {sc.max_stop_string_chars} characters")
    words = data.get("bad_words")
    if isinstance(words, list):
        total = sum(len(w.encode("utf-8", "surrogatepass")) for w in words if isinstance(w, str))
        if total > sc.max_bad_words_bytes:
            refuse("bad_words", f"at most {sc.max_bad_words_bytes} bytes of words in all, got {total}")
    for name in ("guided_json", "guided_regex", "guided_grammar", "structural_tag", "response_format", "tools",
                 "guided_choice"):
        if name in data and _size_over(data[name], sc.max_guided_bytes) is not None:
            refuse(name, f"at most {sc.max_guided_bytes} characters")
    for name in ("extra_args", "vllm_xargs"):
        if name in data and _size_over(data[name], sc.max_extra_args_bytes) is not None:
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


BODY_TIMEOUT = json.dumps(error_body("the request body was not complete in time (server.body_timeout_s)",
                                     code="body_timeout")).encode()
BODY_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\ncontent-length: "
                + str(len(BODY_TIMEOUT)).encode() + b"\r\nconnection: close\r\n\r\n" + BODY_TIMEOUT)


def capped_http_protocol(max_connections: int, header_timeout_s: float | None = None,
                         send_buffer_bytes: int | None = None, body_timeout_s: float | None = None):
    """uvicorn's h11 protocol with three bounds uvicorn does not have:

    - past ``max_connections``, a connection is answered with a 503
      (OpenAI-shaped, ``code: too_many_connections``) and closed once its
      request head has arrived, or after a second;
    - a request head (the request line and headers) must be complete within
      ``header_timeout_s`` of the connection, or of its first byte on a
      kept-alive connection: a client that trickles headers gets a 408 and
      is closed (h11 itself waits forever);
    - a request body must be complete within ``body_timeout_s`` of the end
      of its head (per connection, whatever its Content-Length): a client
      that trickles its body gets a 408 and is closed, so slow bodies cannot
      hold every connection slot (issue 35 item 6);
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

        _body_timer: asyncio.TimerHandle | None = None

        def _arm_body_timer(self) -> None:
            if body_timeout_s and self._body_timer is None:
                self._body_timer = self.loop.call_later(body_timeout_s, self._body_timed_out)

        def _disarm_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None

        def _body_timed_out(self) -> None:
            self._body_timer = None
            if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
                return
            if self.flow.read_paused:             # the app has not taken what came: not the client's delay
                self._arm_body_timer()
                return
            refusals.warning("closing connections whose request body was not complete within %g s "
                             "(server.body_timeout_s; 408)", body_timeout_s)
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(BODY_TIMEOUT)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if not self.refused:
                if self.conn.their_state is h11.IDLE:    # a head begins (or goes on): its clock runs
                    self._arm_head_timer()
                super().data_received(data)
                if self.conn.their_state is not h11.IDLE:
                    self._disarm_head_timer()
                if self.conn.their_state is h11.SEND_BODY:   # a body begins (or goes on): its clock runs
                    self._arm_body_timer()
                else:
                    self._disarm_body_timer()
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
                self._disarm_body_timer()
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
