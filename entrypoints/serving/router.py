"""``fdx router``: one OpenAI endpoint in front of prefill and decode instances.

For each generation request the router picks the least loaded decode
instance (its own count of requests in flight there, plus the instance's
``queued`` from its ``/load``) and a prefill instance (the same way), then:

1. opens the request on the decode instance, marked ``extra_args:
   {"splitwise": {"remote_prefill": true, "transfer_id": T}}``: it waits
   there for its KV;
2. sends it to the prefill instance with ``max_tokens: 1`` and
   ``{"splitwise": {"remote_decode": <decode connector>, "transfer_id":
   T}}``: the prefill instance computes the prompt and pushes the KV to the
   decode instance (plugins/cache/splitwise.py);
3. streams the decode instance's answer back (or returns it whole).

Before anything reaches the client, a refusal is retried on another pair:
a decode instance that answers 429/5xx or ends the request with a
splitwise refusal (no free KV blocks, no offer) or cannot be reached.
An instance that cannot be reached leaves the rotation until its
``/health`` answers again (checked every ``health_interval_s``). Errors
after the first token reach the client as an error event in the stream.
"""
import argparse
import asyncio
import json
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from urllib.parse import urlparse

import httpx

from fdx.entrypoints.serving.protocol import error_body

log = logging.getLogger("fdx.router")

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


@dataclass(eq=False)
class Instance:
    url: str
    role: str
    up: bool = True
    connector: str | None = None          # decode: the splitwise connector's address
    in_flight: int = 0                    # this router's requests there now
    queued: int = 0                       # the instance's own /load figure
    pulls: int = 0

    @property
    def score(self) -> int:
        return self.in_flight + self.queued


class Refused(Exception):
    """The pairing was refused before any output: try another. ``role``:
    the instance to leave out of the next pairing ("decode" or "prefill")."""

    def __init__(self, message: str, role: str = "decode"):
        super().__init__(message)
        self.role = role


class PrefillAnswered(Exception):
    """The prefill instance refused the request (a 4xx) before any output:
    its answer goes to the client, as the decode instance's would."""

    def __init__(self, status: int, raw: bytes):
        super().__init__(status)
        self.status, self.raw = status, raw


@dataclass
class Router:
    prefill: list[Instance]
    decode: list[Instance]
    timeout_s: float = 600.0
    health_interval_s: float = 1.0

    def __post_init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge
        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("fdx_router:requests", "Requests by outcome.", ["outcome"], registry=r)
        self.m_retries = Counter("fdx_router:retries", "Pairings refused and retried elsewhere.", registry=r)
        self.m_up = Gauge("fdx_router:instance_up", "1 while the instance is in rotation.", ["role", "url"],
                          registry=r)
        self.m_sent = Counter("fdx_router:instance_requests", "Requests sent per instance.", ["role", "url"],
                              registry=r)
        for inst in self.prefill + self.decode:
            self.m_up.labels(inst.role, inst.url).set(1)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=5.0))

    # -- rotation ----------------------------------------------------------------------
    def _mark(self, inst: Instance, up: bool) -> None:
        if inst.up != up:
            log.warning("router: %s instance %s %s", inst.role, inst.url, "back in rotation" if up else
                        "out of rotation")
        inst.up = up
        self.m_up.labels(inst.role, inst.url).set(1 if up else 0)

    async def refresh(self, inst: Instance) -> None:
        try:
            h = await self.client.get(inst.url + "/health", timeout=3.0)
            info = (await self.client.get(inst.url + "/load", timeout=3.0)).json() if h.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        if info is None:
            self._mark(inst, False)
            return
        inst.queued = int(info.get("queued") or 0)
        if inst.role == "decode":
            conn = info.get("connector")
            if not conn:
                log.error("router: %s is not a decode instance (splitwise.role: %s)", inst.url, info.get("role"))
                self._mark(inst, False)
                return
            host = urlparse(conn).hostname
            if host in ("0.0.0.0", "::", None):
                conn = conn.replace(f"//{host}", f"//{urlparse(inst.url).hostname}", 1)
            inst.connector = conn
        self._mark(inst, True)

    async def watch(self) -> None:
        while True:
            await asyncio.gather(*(self.refresh(i) for i in self.prefill + self.decode))
            await asyncio.sleep(self.health_interval_s)

    def pick(self, pool: list[Instance], exclude: set) -> Instance | None:
        live = [i for i in pool if i.up and i not in exclude and (i.role != "decode" or i.connector)]
        return min(live, key=lambda i: i.score) if live else None

    # -- one request --------------------------------------------------------------------
    async def generate(self, path: str, body: dict, headers: dict):
        from fastapi.responses import JSONResponse, Response
        tried_d: set = set()
        tried_p: set = set()
        why: list[str] = []                       # each refused pairing: which instance, its role, what
        while True:
            d = self.pick(self.decode, tried_d)
            p = self.pick(self.prefill, tried_p)
            if d is None or p is None:
                self.m_requests.labels("unavailable").inc()
                which = "decode" if d is None else "prefill"
                tried = f" ({'; '.join(why[-4:])})" if why else ""
                return JSONResponse(error_body(f"no {which} instance available{tried}", "service_unavailable"),
                                    status_code=503)
            try:
                return await self._pair(path, body, headers, p, d)
            except PrefillAnswered as e:
                self.m_requests.labels("client_error").inc()
                return Response(e.raw, status_code=e.status, media_type="application/json")
            except Refused as e:
                log.warning("router: pairing prefill %s -> decode %s refused: %s", p.url, d.url, e)
                self.m_retries.inc()
                why.append(str(e))
                (tried_p if e.role == "prefill" else tried_d).add(p if e.role == "prefill" else d)

    async def _pair(self, path: str, body: dict, headers: dict, p: Instance, d: Instance):
        from fastapi.responses import Response
        tid = "sw" + secrets.token_hex(8)
        extra = dict(body.get("extra_args") or body.get("vllm_xargs") or {})
        d_body = {k: v for k, v in body.items() if k != "vllm_xargs"}
        d_body["extra_args"] = {**extra, "splitwise": {"remote_prefill": True, "transfer_id": tid}}
        p_body = {k: v for k, v in d_body.items() if k not in ("stream", "stream_options")}
        p_body["extra_args"] = {**extra, "splitwise": {"remote_decode": d.connector, "transfer_id": tid}}
        p_body["max_tokens"] = 1
        p_body.pop("max_completion_tokens", None)
        p_body.pop("min_tokens", None)
        stream = bool(body.get("stream"))

        d.in_flight += 1
        self.m_sent.labels("decode", d.url).inc()
        released = False

        def release():
            nonlocal released
            if not released:
                released = True
                d.in_flight -= 1

        try:
            req = self.client.build_request("POST", d.url + path, json=d_body, headers=headers)
            d_task = asyncio.ensure_future(self.client.send(req, stream=True))
            await asyncio.sleep(0)
            p_task = asyncio.ensure_future(self._prefill(path, p_body, headers, p))
            try:
                resp = await d_task
            except httpx.HTTPError as e:
                p_task.cancel()
                self._mark(d, False)
                raise Refused(f"decode instance {d.url} failed: {e!r}") from None
            if resp.status_code != 200:
                raw = await resp.aread()
                await resp.aclose()
                p_task.cancel()
                if resp.status_code in RETRYABLE_STATUS:
                    raise Refused(f"decode instance {d.url} answered {resp.status_code}: "
                                  f"{raw[:200].decode('utf-8', 'replace')}")
                self.m_requests.labels("client_error").inc()
                return Response(raw, status_code=resp.status_code, media_type="application/json")
            return await (self._stream(resp, p_task, release, p, d) if stream else self._whole(resp, p_task, p, d))
        except BaseException:
            release()
            raise
        finally:
            if not stream:
                release()

    async def _prefill(self, path: str, body: dict, headers: dict, p: Instance) -> tuple[int, bytes] | str:
        """(status, body) of the prefill instance's answer, or why it failed (the text names it)."""
        p.in_flight += 1
        self.m_sent.labels("prefill", p.url).inc()
        try:
            r = await self.client.post(p.url + path, json=body, headers=headers)
            if r.status_code != 200:
                log.warning("router: prefill %s answered %s: %s", p.url, r.status_code, r.text[:300])
            return r.status_code, r.content
        except httpx.HTTPError as e:
            self._mark(p, False)
            log.warning("router: prefill instance %s failed: %r", p.url, e)
            return f"prefill instance {p.url} failed: {e!r}"
        finally:
            p.in_flight -= 1

    async def _until_output(self, step, p_task, p: Instance):
        """Await ``step`` (the decode instance's next line or whole answer)
        while the prefill request runs: a prefill instance that fails, or
        answers a 5xx, before ``step`` is done ends the pairing as Refused
        naming it (its KV will never come); one that refuses the request
        (4xx) ends it with that answer (PrefillAnswered)."""
        step = asyncio.ensure_future(step)
        while not p_task.done():
            await asyncio.wait({step, p_task}, return_when=asyncio.FIRST_COMPLETED)
            if step.done():
                return step.result()
        if not p_task.cancelled():
            out = p_task.result()
            if isinstance(out, str) or out[0] >= 500 or out[0] == 429:
                step.cancel()
                why = out if isinstance(out, str) else \
                    f"prefill instance {p.url} answered {out[0]}: {out[1][:200].decode('utf-8', 'replace')}"
                raise Refused(why, role="prefill")
            if out[0] >= 400:
                step.cancel()
                raise PrefillAnswered(out[0], out[1])
        return await step

    def _blame(self, reason: str, p: Instance, d: Instance) -> Refused:
        """A splitwise refusal the decode instance reported, naming the
        instance at fault and its role: a transfer that never came, or was
        aborted, is the prefill instance's (it leaves this request's
        pairings and its health is checked now); the rest the decode's."""
        if "prefill instance" in reason:
            asyncio.ensure_future(self.refresh(p))
            return Refused(f"prefill instance {p.url} (as decode instance {d.url} reports): {reason}",
                           role="prefill")
        return Refused(f"decode instance {d.url}: {reason}")

    @staticmethod
    def _refusal(choices: list[dict]) -> str | None:
        for c in choices:
            reason = c.get("stop_reason")
            if c.get("finish_reason") == "abort" and isinstance(reason, str) and reason.startswith("splitwise:"):
                return reason
        return None

    async def _whole(self, resp: httpx.Response, p_task, p: Instance, d: Instance):
        from fastapi.responses import JSONResponse, Response
        try:
            raw = await self._until_output(resp.aread(), p_task, p)
        except httpx.HTTPError as e:          # the decode instance died before it answered
            self.m_requests.labels("error").inc()
            return JSONResponse(error_body(f"the decode instance failed: {e}", "service_unavailable"),
                                status_code=502)
        finally:
            await resp.aclose()
        try:
            data = json.loads(raw)
        except ValueError:
            data = {}
        reason = self._refusal(data.get("choices") or [])
        if reason is not None:
            raise self._blame(reason, p, d)
        self.m_requests.labels("ok").inc()
        return Response(raw, status_code=200, media_type="application/json")

    async def _stream(self, resp: httpx.Response, p_task, release, p: Instance, d: Instance):
        from fastapi.responses import JSONResponse, StreamingResponse
        """Hold the chunks back until the first one with output (or the end),
        so a refusal can still be retried; then pass everything through."""
        lines = resp.aiter_lines()
        held: list[str] = []
        try:
            while True:
                try:
                    line = await self._until_output(lines.__anext__(), p_task, p)
                except StopAsyncIteration:
                    break
                held.append(line)
                if not line.startswith("data: ") or line == "data: [DONE]":
                    if line == "data: [DONE]":
                        break
                    continue
                try:
                    chunk = json.loads(line[6:])
                except ValueError:
                    break
                choices = chunk.get("choices") or []
                reason = self._refusal(choices)
                if reason is not None:
                    raise self._blame(reason, p, d)
                if "error" in chunk or any(c.get("finish_reason") or (c.get("text") or
                                           (c.get("delta") or {}).get("content")) for c in choices):
                    break
        except httpx.HTTPError as e:
            await resp.aclose()
            release()
            self.m_requests.labels("error").inc()
            return JSONResponse(error_body(f"the decode instance failed: {e}", "service_unavailable"),
                                status_code=502)
        except (Refused, PrefillAnswered):
            await resp.aclose()
            release()
            raise

        async def rest():
            try:
                for line in held:
                    yield line + "\n"
                async for line in lines:
                    yield line + "\n"
                self.m_requests.labels("ok").inc()
            except httpx.HTTPError as e:          # the decode instance died mid-stream
                self.m_requests.labels("error").inc()
                body = error_body(f"the decode instance failed: {e}", "service_unavailable")
                yield f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"
            finally:
                await resp.aclose()
                release()
        return StreamingResponse(rest(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def build_router_app(router: Router, sc=None):
    """The router's endpoints behind the same edge as ``fdx serve``
    (entrypoints/serving/edge.py): the key and the body limit before the body is
    read, then the same schema and per-request limits, so nothing malformed
    or oversized reaches an instance. ``sc``: a ServerConfig (its api_key,
    max_request_body_bytes and max_* limits; defaults if None)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response
    from prometheus_client import generate_latest

    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving import edge
    from fdx.entrypoints.serving.protocol import ChatCompletionRequest, CompletionRequest
    sc = sc if sc is not None else ServerConfig()
    app = FastAPI(title="fdx router")
    app.router.redirect_slashes = False       # a 404 naming the path, as fdx serve
    edge.install(app, sc)

    def fwd_headers(request: Request) -> dict:
        """What the instances get: the key, the request id (the client's X-Request-Id, else
        the one the edge made: both instances and the router log the same) and the W3C
        trace context, so their engines' spans join the client's trace."""
        auth = request.headers.get("authorization")
        out = {"authorization": auth} if auth else {}
        trace = request.scope.get("fdx.trace") or {}
        out.update({k: v for k, v in trace.items() if k in ("x-request-id", "traceparent", "tracestate")})
        return out

    async def checked_body(request: Request, schema) -> dict:
        req, body = await edge.read_request(request, schema, sc, with_data=True)   # large ones off the loop
        edge.check_limits(req, sc)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await checked_body(request, CompletionRequest)
        return await router.generate("/v1/completions", body, fwd_headers(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await checked_body(request, ChatCompletionRequest)
        return await router.generate("/v1/chat/completions", body, fwd_headers(request))

    @app.get("/v1/models")
    async def models(request: Request):
        d = router.pick(router.decode, set())
        if d is None:
            return JSONResponse(error_body("no decode instance available", "service_unavailable"), status_code=503)
        r = await router.client.get(d.url + "/v1/models", headers=fwd_headers(request))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        if router.pick(router.decode, set()) and router.pick(router.prefill, set()):
            return {"status": "ok"}
        return JSONResponse(error_body("no prefill or no decode instance in rotation", "service_unavailable"),
                            status_code=503)

    @app.get("/status")
    async def status():
        return {"prefill": [vars_of(i) for i in router.prefill], "decode": [vars_of(i) for i in router.decode]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type="text/plain; version=0.0.4")

    return app


def vars_of(i: Instance) -> dict:
    return {"url": i.url, "up": i.up, "connector": i.connector, "in_flight": i.in_flight, "queued": i.queued}


def add_parser(sub) -> argparse.ArgumentParser:
    r = sub.add_parser("router", help="one OpenAI endpoint in front of prefill and decode instances",
                       description="Route each request to a prefill and a decode instance (splitwise). "
                                   "See docs/deployment.md.")
    r.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances (http://host:port); required, no default")
    r.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (http://host:port); required, no default")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds per upstream request (default 600)")
    r.add_argument("--health-interval", type=float, default=1.0, help="seconds between instance checks (default 1)")
    r.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on /v1, checked before the body is read "
                        "(default $FDX_API_KEY; the instances' key, which the router passes on)")
    r.add_argument("--max-request-body-bytes", type=int, default=4 * 1024 * 1024,
                   help="larger request bodies get 413 before they are read whole (default 4 MiB)")
    r.add_argument("--max-connections", type=int, default=None,
                   help="open client connections; past it 503 at once (default: what the descriptor limit leaves)")
    r.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default warning)")
    r.set_defaults(func=cmd_router)
    return r


def _check_url(flag: str, url: str) -> str:
    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"{flag}: {url!r} is not an http(s)://host:port URL")
    return url.rstrip("/")


def cmd_router(args) -> int:
    import uvicorn

    from fdx.entrypoints.serving.signals import GracefulServer
    try:
        pre = [Instance(_check_url("--prefill", u), "prefill") for u in args.prefill]
        dec = [Instance(_check_url("--decode", u), "decode") for u in args.decode]
    except ValueError as e:
        print(f"fdx router: error: {e}", file=sys.stderr)
        return 2
    from fdx.core.logs import configure
    configure(args.log_level)
    from fdx.core.config import ServerConfig
    from fdx.entrypoints.serving import edge
    try:
        sc = ServerConfig(api_key=args.api_key or os.environ.get("FDX_API_KEY") or None,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_connections=args.max_connections)
    except ValueError as e:
        print(f"fdx router: error: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        router = Router(pre, dec, timeout_s=args.timeout, health_interval_s=args.health_interval)
        await asyncio.gather(*(router.refresh(i) for i in pre + dec))
        watcher = asyncio.create_task(router.watch())
        config = uvicorn.Config(build_router_app(router, sc), host=args.host, port=args.port,
                                log_level=args.log_level, access_log=False, lifespan="off",
                                http=edge.capped_http_protocol(edge.connection_cap(sc.max_connections),
                                                               sc.header_timeout_s, sc.socket_send_buffer_bytes,
                                                               sc.body_timeout_s))
        edge.quiet_accept_errors()
        print(f"fdx router: http://{args.host}:{args.port}/v1 -> prefill {', '.join(args.prefill)}; "
              f"decode {', '.join(args.decode)}", flush=True)
        try:
            await GracefulServer(config).serve()       # SIGTERM, Ctrl-C: exit 0
        finally:
            watcher.cancel()
            await router.client.aclose()

    asyncio.run(main())
    return 0
