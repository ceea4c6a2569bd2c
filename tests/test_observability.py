"""Request ids, tracing and metrics of a real ``fdx serve`` (docs/observability.md).

One server on a tiny random-weight Llama, with two observers selected by
config: the built-in ``otel`` (its console exporter writing each finished
span as a JSON line to a file: the spans are made in the engine process)
and tests/plugin_pkg's ``example-recorder`` (an outside ``Observer`` class
that writes each request it sees added and finished). Clients are httpx and
the openai client; every figure is checked against what the client itself
received or measured.
"""
from __future__ import annotations

import contextlib
import json
import re
import secrets
import time

import httpx
import openai
import pytest
from serve_utils import API_KEY, ServerProcess

pytestmark = pytest.mark.slow
pytest.importorskip("opentelemetry.sdk")

HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model, example_plugin_installed):
    tmp = tmp_path_factory.mktemp("observability")
    srv = ServerProcess(tmp, model={"model": tiny_model, "max_model_len": 512},
                        cache={"num_kv_blocks": 96}, scheduler={"max_num_seqs": 8},
                        observability={"observers": ["otel", "example-recorder"]},
                        plugins={"observer": {"otel": {"exporter": "console", "file": str(tmp / "spans.jsonl")},
                                              "example-recorder": {"path": str(tmp / "records.jsonl")}}})
    srv.spans_path, srv.records_path = tmp / "spans.jsonl", tmp / "records.jsonl"
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def jsonl(path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_until(pred, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def idle(server) -> bool:
    m = server.metrics()
    return (m["fdx:num_requests_running"] == 0 and m["fdx:num_requests_waiting"] == 0
            and m["fdx:api_requests_in_flight"] == 0)


def sse(resp):
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


BODY = {"prompt": [101, 202, 303, 404], "max_tokens": 6, "ignore_eos": True, "temperature": 0}


# -- X-Request-Id ---------------------------------------------------------------------------

def _refused_with_its_body_sent(server, headers: dict) -> bytes:
    """A POST whose headers are refused, its small body sent a moment after them (as a client
    that writes headers and body apart: httpx does), the answer read after that: everything the
    socket gives, or the error it raised."""
    import socket
    body = json.dumps({**BODY, "prompt": "x" * 2000}).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}"
           f"Content-Length: {len(body)}\r\n\r\n").encode()
    got = b""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        try:
            s.sendall(raw)
            time.sleep(0.3)                 # the old server had answered and closed by now
            s.sendall(body)
            time.sleep(0.3)
            while chunk := s.recv(65536):
                got += chunk
        except OSError as e:                # a reset: the answer is lost
            return got + f" [{type(e).__name__}: {e}]".encode()
    return got


def test_a_bad_request_id_refusal_reaches_a_client_that_sends_its_body_late(server):
    """CI once read "connection reset by peer" instead of this 400 in the request-id test: the
    400 was sent and the connection closed with the request's body unread, and a reset can take
    the refusal's bytes with it. The body (within the limit) is now read first. (This replay did
    not fail on the old code on the machine it was written on: Linux delivered the answer before
    the reset there.)"""
    got = _refused_with_its_body_sent(server, {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "has space"})
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_request_id"


def test_request_id_is_echoed_used_by_the_engine_and_logged(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        r = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "trace-abc.1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-abc.1"
        assert r.json()["id"] == "cmpl-trace-abc.1"                     # vLLM's shape of the response id
        with http.stream("POST", "/v1/chat/completions", headers={"X-Request-Id": "chat:7/x"},
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                               "stream": True}) as s:
            assert s.status_code == 200 and s.headers["x-request-id"] == "chat:7/x"
            assert {ev["id"] for ev in sse(s)} == {"chatcmpl-chat:7/x"}
        made = http.post("/v1/completions", json=BODY)                   # none sent: one is made
        assert re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
        assert made.json()["id"] == "cmpl-" + made.headers["x-request-id"]
        # errors carry it too: a bad body, a missing key, a bad header (which gets a fresh id)
        bad = http.post("/v1/completions", json={**BODY, "bogus": 1}, headers={"X-Request-Id": "err-1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "err-1"
        nokey = httpx.post(server.base_url + "/v1/completions", json=BODY, headers={"X-Request-Id": "nokey-1"})
        assert nokey.status_code == 401 and nokey.headers["x-request-id"] == "nokey-1"
        for value in ("has space", "x" * 129, "", "quote\"d", "semi;colon"):
            r = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": value})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "X-Request-Id", (value, r.text)
            assert err["code"] == "invalid_request_id" and "X-Request-Id" in err["message"]
            assert r.headers["x-request-id"] != value
        r = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "é".encode()})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        assert http.get("/health", headers={"X-Request-Id": "has space"}).status_code == 200   # /v1 only
    # the engine ran the request under that id (one engine request per choice: <id>-<index>)
    records = wait_until(lambda: [r for r in jsonl(server.records_path) if r["request_id"] == "trace-abc.1-0"],
                         "the recorder's lines")
    added = next(r for r in records if r["event"] == "added")
    assert added["trace_headers"] == {"x-request-id": "trace-abc.1"} and added["num_prompt_tokens"] == 4
    finished = wait_until(lambda: [r for r in jsonl(server.records_path)
                                   if r["request_id"] == "trace-abc.1-0" and r["event"] == "finished"], "finish")
    assert len(finished[0]["token_ids"]) == 6 and finished[0]["finish_reason"] == "length"
    # and the server's log line for each request names it
    log = server.log_path.read_text()
    assert re.search(r"request trace-abc\.1: POST /v1/completions 200 in [0-9.]+ s, 1 sequence, "
                     r"4 prompt \+ 6 generated tokens, finish length", log), log[-3000:]
    assert re.search(r"request chat:7/x: POST /v1/chat/completions 200 ", log)
    assert re.search(r"request err-1: POST /v1/completions 400 ", log)
    assert re.search(r"request nokey-1: POST /v1/completions 401 ", log)
    assert "Traceback" not in log


def test_a_request_id_reused_while_in_flight_still_runs(server):
    """Two requests with the same X-Request-Id at once: both answered, each
    echoing it; the engine keeps them apart (the second one's engine ids get
    a suffix)."""
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        with http.stream("POST", "/v1/completions", headers={"X-Request-Id": "dup"},
                         json={**BODY, "max_tokens": 200, "stream": True}) as first:
            assert first.status_code == 200
            events = sse(first)                    # held: a dropped generator closes the stream
            next(events)
            second = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "dup"})
            assert second.status_code == 200 and second.headers["x-request-id"] == "dup"
            assert second.json()["choices"][0]["finish_reason"] == "length"
            assert next(events)["choices"][0]["finish_reason"] is None           # the first one still runs
    added = wait_until(lambda: {r["request_id"] for r in jsonl(server.records_path)
                                if r["event"] == "added" and (r["trace_headers"] or {}).get("x-request-id") == "dup"} or None,
                       "both requests in the engine")
    assert "dup-0" in added and any(re.fullmatch(r"dup\.[0-9a-f]{6}-0", a) for a in added), added


def _finished_record(server, request_id: str) -> dict:
    return wait_until(lambda: [r for r in jsonl(server.records_path)
                               if r["request_id"] == request_id and r["event"] == "finished"],
                      f"{request_id} finished in the engine")[0]


def _request_span(server, request_id: str) -> dict:
    return wait_until(lambda: [s for s in jsonl(server.spans_path) if s["name"] == "fdx.request"
                               and s["attributes"].get("fdx.request_id") == request_id], f"{request_id}'s span")[0]


def test_a_stop_string_ends_the_engine_request_as_stop_and_a_disconnect_as_abort(server):
    """The engine process's token processor finds stop strings and ends the
    request as stopped, as ``LLM``'s does, so its observers (the
    recorder, the otel span) see finish reason "stop" and the tokens the
    client got, not an "abort" with a token or two more. A client that goes
    away is still an abort there, and in fdx:request_success."""
    from test_output_path import pick_stop
    wait_until(lambda: idle(server), "idle")

    def successes(reason):
        return sum(v for k, v in server.metrics().items()
                   if k.startswith("fdx:request_success_total{") and f'finished_reason="{reason}"' in k)
    before = {r: successes(r) for r in ("stop", "abort")}
    body = {**BODY, "max_tokens": 24}
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        plain = http.post("/v1/completions", json=body, headers={"X-Request-Id": "unstopped"}).json()
        stop = pick_stop(plain["choices"][0]["text"], 3)
        r = http.post("/v1/completions", json={**body, "stop": [stop]}, headers={"X-Request-Id": "stopped"})
        assert r.status_code == 200, r.text
        got = r.json()
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 400, "stream": True},
                         headers={"X-Request-Id": "gone"}) as s:
            events = sse(s)
            next(events)
            next(events)                                   # two tokens in: then the client leaves
    choice = got["choices"][0]
    assert choice["finish_reason"] == "stop" and stop not in choice["text"]
    assert plain["choices"][0]["text"].startswith(choice["text"])
    kept = got["usage"]["completion_tokens"]
    assert 0 < kept < 24
    ref = _finished_record(server, "unstopped-0")
    rec = _finished_record(server, "stopped-0")
    assert rec["finish_reason"] == "stop"                  # it was "abort"
    assert rec["token_ids"] == ref["token_ids"][:kept]     # what the client got, nothing computed past it
    span = _request_span(server, "stopped")
    assert span["attributes"]["gen_ai.response.finish_reasons"] == ["stop"]
    assert span["attributes"]["gen_ai.usage.output_tokens"] == kept
    gone = _finished_record(server, "gone-0")
    assert gone["finish_reason"] == "abort" and 2 <= len(gone["token_ids"]) < 400
    assert _request_span(server, "gone")["attributes"]["gen_ai.response.finish_reasons"] == ["abort"]
    wait_until(lambda: idle(server), "idle")
    assert successes("stop") - before["stop"] == 1 and successes("abort") - before["abort"] == 1


# -- traceparent -> spans in the engine ---------------------------------------------------------

def test_a_traced_request_has_queue_prefill_and_decode_spans_under_its_trace(server):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    raw = client.completions.with_raw_response.create(
        model=_model(server), prompt=[7, 8, 9, 10, 11],
        max_tokens=5, n=2, temperature=0.8, seed=3, extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "traced-1", "traceparent": f"00-{trace_id}-{parent_id}-01",
                       "tracestate": "vendor=abc"})
    assert raw.headers["x-request-id"] == "traced-1"
    completion = raw.parse()

    def spans():
        mine = [s for s in jsonl(server.spans_path) if s["attributes"].get("fdx.request_id") == "traced-1"]
        return mine if sum(s["name"] == "fdx.request" for s in mine) == 2 else None
    mine = wait_until(spans, "the spans of both choices")
    by_name: dict[str, list] = {}
    for s in mine:
        by_name.setdefault(s["name"], []).append(s)
    assert {k: len(v) for k, v in by_name.items()} == {"fdx.request": 2, "fdx.queue": 2, "fdx.prefill": 2,
                                                        "fdx.decode": 2}
    assert {s["context"]["trace_id"] for s in mine} == {"0x" + trace_id}      # all in the caller's trace
    roots = {s["context"]["span_id"]: s for s in by_name["fdx.request"]}
    for root in roots.values():
        assert root["parent_id"] == "0x" + parent_id and root["kind"] == "SpanKind.SERVER"
        assert root["attributes"]["gen_ai.usage.input_tokens"] == 5
        assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]
    assert sorted(r["attributes"]["fdx.engine_request_id"] for r in roots.values()) == ["traced-1-0", "traced-1-1"]
    for name in ("fdx.queue", "fdx.prefill", "fdx.decode"):
        for s in by_name[name]:
            root = roots[s["parent_id"]]                                    # each under its choice's span
            assert s["attributes"]["fdx.engine_request_id"] == root["attributes"]["fdx.engine_request_id"]
    # the tokens the spans count are the ones the client got
    assert sum(r["attributes"]["gen_ai.usage.output_tokens"] for r in roots.values()) \
        == completion.usage.completion_tokens == 10
    # the tracestate travelled with it to the engine
    records = [r for r in jsonl(server.records_path) if r["event"] == "added"
               and (r["trace_headers"] or {}).get("x-request-id") == "traced-1"]
    assert records and all(r["trace_headers"]["tracestate"] == "vendor=abc" for r in records)


def test_a_malformed_traceparent_starts_a_new_trace(server):
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        r = http.post("/v1/completions", json=BODY, headers={"X-Request-Id": "badtp",
                                                            "traceparent": "00-zz-not-a-trace"})
        assert r.status_code == 200
    root = wait_until(lambda: [s for s in jsonl(server.spans_path) if s["name"] == "fdx.request"
                               and s["attributes"].get("fdx.request_id") == "badtp"], "its span")[0]
    assert root["parent_id"] is None


def _model(server) -> str:
    return httpx.get(server.base_url + "/v1/models", headers=HEADERS).json()["data"][0]["id"]


# -- metrics -------------------------------------------------------------------------------

def test_generation_tokens_total_rises_while_a_request_streams(server):
    wait_until(lambda: idle(server), "idle")
    before = server.metrics()["fdx:generation_tokens_total"]
    received = 0
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 400, "stream": True,
                                                         "logprobs": 0}) as s:
            events = sse(s)
            for ev in events:
                received += len(ev["choices"][0]["logprobs"]["tokens"])    # one entry per token
                if received >= 5:
                    break
            mid = server.metrics()
            assert mid["fdx:num_requests_running"] == 1                    # still streaming
            assert mid["fdx:generation_tokens_total"] - before >= received
            assert mid["fdx:generation_tokens_total"] - before < 400
            for ev in events:
                received += len(ev["choices"][0]["logprobs"]["tokens"]) if ev["choices"] else 0
    assert received == 400
    assert server.metrics()["fdx:generation_tokens_total"] - before == 400


def test_histograms_are_fed_by_every_request(server):
    """Counts equal the requests made; sums agree with the client's own
    counts, and the engine's times fit inside what the client measured
    (each happened between the client's send and its last byte)."""
    wait_until(lambda: idle(server), "idle")
    m0 = server.metrics()
    runs = []
    with httpx.Client(base_url=server.base_url, headers=HEADERS, timeout=60) as http:
        for i, (plen, max_tokens) in enumerate([(3, 4), (11, 9), (25, 2), (40, 13)]):
            body = {"prompt": list(range(300 + i, 300 + i + plen)), "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0}
            t0 = time.monotonic()
            first = None
            with http.stream("POST", "/v1/completions", json=body) as s:
                for ev in sse(s):
                    if ev["choices"] and ev["choices"][0]["logprobs"]["tokens"] and first is None:
                        first = time.monotonic()
                    if ev.get("usage"):
                        usage = ev["usage"]
            runs.append({"ttft": first - t0, "e2e": time.monotonic() - t0, **usage})
    wait_until(lambda: idle(server), "idle")
    m = server.metrics()

    def delta(name):
        return m.get(name, 0.0) - m0.get(name, 0.0)
    k = len(runs)
    for h in ("request_prompt_tokens", "request_generation_tokens", "request_prefill_time_seconds",
              "request_decode_time_seconds", "time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"):
        assert delta(f"fdx:{h}_count") == k, h
    assert delta("fdx:request_prompt_tokens_sum") == sum(r["prompt_tokens"] for r in runs) == 3 + 11 + 25 + 40
    assert delta("fdx:request_generation_tokens_sum") == sum(r["completion_tokens"] for r in runs) == 28
    assert delta("fdx:prompt_tokens_total") == 79 and delta("fdx:generation_tokens_total") == 28
    assert delta("fdx:inter_token_latency_seconds_count") == sum(r["completion_tokens"] - 1 for r in runs)
    ttft, e2e = sum(r["ttft"] for r in runs), sum(r["e2e"] for r in runs)
    assert 0 < delta("fdx:time_to_first_token_seconds_sum") <= ttft
    assert 0 < delta("fdx:request_queue_time_seconds_sum") + delta("fdx:request_prefill_time_seconds_sum") <= ttft
    assert 0 < delta("fdx:request_decode_time_seconds_sum") <= e2e
    assert 0 < delta("fdx:inter_token_latency_seconds_sum") <= e2e
    assert 0 < delta("fdx:e2e_request_latency_seconds_sum") <= e2e


# -- the API's schema and pages, behind the key ----------------------------------------------------

def test_openapi_and_docs_need_the_key(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        r = httpx.get(server.base_url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(server.base_url + path, headers=HEADERS).status_code == 200, path
    schema = httpx.get(server.base_url + "/openapi.json", headers=HEADERS).json()
    assert "/v1/completions" in schema["paths"]
