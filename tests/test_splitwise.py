"""The splitwise KV connector: a prefill and a decode engine in this process,
talking over ZMQ on loopback TCP, against one mixed engine on the same
weights; and the protocol's refusals (garbage, truncated, wrong version,
wrong secret, wrong shape, unknown ids, timeouts)."""
from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import zmq

from serve_utils import free_port
from splitwise_utils import greedy as _greedy
from splitwise_utils import run

from fdx.core.config import FdxConfig
from fdx.core.engine import EngineCore
from fdx.core.request import RequestStatus
from fdx.plugins.cache.splitwise import PROTOCOL_VERSION, Accept, Blocks, Offer, Refuse
from fdx.plugins.cache.splitwise_wire import seal

SECRET = "s3cret"
MAX_TOKENS = 6
PROMPTS = [list(range(100, 100 + n)) for n in (1, 5, 16, 17, 40)]   # in and across block boundaries


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])
    port = free_port()
    common = dict(model=model, max_model_len=128, block_size=16, num_kv_blocks=24)
    sw = {"connector_secret": SECRET, "transfer_timeout_s": 4.0}
    mixed = EngineCore(FdxConfig.build(**common), progress=False)
    pre = EngineCore(FdxConfig.build(**common, splitwise={**sw, "role": "prefill"}), progress=False)
    dec = EngineCore(FdxConfig.build(**common, splitwise={**sw, "role": "decode", "connector_port": port}),
                     progress=False)
    yield mixed, pre, dec, f"tcp://127.0.0.1:{port}"
    pre.shutdown()
    dec.shutdown()


def greedy(max_tokens=MAX_TOKENS, **extra):
    return _greedy(max_tokens, **extra)



def disaggregated(pre, dec, peer, prompts, tag: str, max_tokens=MAX_TOKENS):
    for i, p in enumerate(prompts):
        rid = f"{tag}{i}"
        dec.add_request(dec.make_request(p, greedy(max_tokens, splitwise={"remote_prefill": True}), request_id=rid))
        pre.add_request(pre.make_request(p, greedy(1, splitwise={"remote_decode": peer}), request_id=rid))
    done = run(pre, dec)
    return {rid: r for (eid, rid), r in done.items() if eid == id(dec)}


def test_prefill_and_decode_equal_one_mixed_engine(engines):
    mixed, pre, dec, peer = engines
    for i, p in enumerate(PROMPTS):
        mixed.add_request(mixed.make_request(p, greedy(), request_id=f"m{i}"))
    ref = {rid: r.output_token_ids for (_, rid), r in run(mixed).items()}
    before_pre, before_dec = pre.num_computed_tokens, dec.num_computed_tokens
    got = disaggregated(pre, dec, peer, PROMPTS, "a")
    for i in range(len(PROMPTS)):
        assert got[f"a{i}"].output_token_ids == ref[f"m{i}"], i
        assert got[f"a{i}"].status is RequestStatus.FINISHED_LENGTH
    # the prompt was computed once, on the prefill side; the decode side computed only the
    # last prompt position of each request (the one a prompt of 1 token has) and the decodes
    assert pre.num_computed_tokens - before_pre == sum(map(len, PROMPTS))
    assert dec.num_computed_tokens - before_dec == len(PROMPTS) * MAX_TOKENS
    ps, ds = pre.connector.stats(), dec.connector.stats()
    moved = [len(p) - 1 for p in PROMPTS if len(p) > 1]
    assert ps["splitwise_transfers_sent"] == ds["splitwise_transfers_received"] == len(moved)
    assert ds["splitwise_bytes_received"] == ps["splitwise_bytes_sent"] == sum(moved) * 2 * 2 * 2 * 16 * 4
    assert ds["splitwise_first_token_agree"] == len(moved) and ds["splitwise_first_token_differ"] == 0
    assert pre.kv_cache.num_free_blocks == pre.kv_cache.num_blocks
    assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks


def test_transferred_kv_is_what_the_decode_side_reads(engines):
    """Corrupt the bytes in flight: the decode side's output changes, so it
    did read the transferred KV (and did not recompute the prompt)."""
    mixed, pre, dec, peer = engines
    prompt = PROMPTS[-1]
    mixed.add_request(mixed.make_request(prompt, greedy(), request_id="c-ref"))
    ref = run(mixed)[(id(mixed), "c-ref")].output_token_ids
    conn = pre.connector
    real = conn._read
    conn._read = lambda job: [np.random.default_rng(0).standard_normal(d.shape).astype(d.dtype) * 5
                              for d in real(job)]
    try:
        got = disaggregated(pre, dec, peer, [prompt], "c")["c0"].output_token_ids
    finally:
        conn._read = real
    assert got != ref


def _decode_reply(frames: list[bytes]):
    """A reply's header: the second frame of a sealed one, the only frame of an unsigned Refuse."""
    return msgspec.msgpack.decode(frames[-1] if len(frames) <= 2 else frames[1], type=Accept | Refuse)


def _ask(peer: str, frames: list[bytes], timeout_ms: int = 5000):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(peer)
    s.send_multipart(frames)
    try:
        if not s.poll(timeout_ms):
            return None
        return _decode_reply(s.recv_multipart())
    finally:
        s.close()


def _offer(rid: str, n: int, fp: dict, v: int = PROTOCOL_VERSION) -> Offer:
    return Offer(v, rid, 0, np.random.bytes(16).hex(), time.time(), n, 1, fp)


@pytest.mark.slow
def test_bad_messages_are_refused_and_the_connector_keeps_working(engines):
    mixed, pre, dec, peer = engines
    enc = msgspec.msgpack.encode
    fp = dict(dec.connector.fingerprint)
    before = dec.connector.stats()["splitwise_messages_rejected"]
    cases = {
        "garbage": [b"\x00\xffnot msgpack at all"],
        "not a splitwise message": [enc({"hello": "world"})],
        "an older peer": [enc({"type": "offer", "v": 1, "request_id": "x"})],
        "version": seal(SECRET, _offer("x", 4, fp, v=PROTOCOL_VERSION + 1)),
        "secret": seal("wrong", _offer("x", 4, fp)),
        "layout": seal(SECRET, _offer("x", 4, {**fp, "head_dim": 999})),
        "no reservation": seal(SECRET, Blocks(PROTOCOL_VERSION, "x", 1, "00", [0], 0, 4, 8), [b"\0" * 8]),
        "tokens": seal(SECRET, _offer("x", -3, fp)),
    }
    for what, frames in cases.items():
        reply = _ask(peer, frames)
        assert isinstance(reply, Refuse), (what, reply)
    # a well-formed offer for a request this instance never saw: refused after the grace period
    reply = _ask(peer, seal(SECRET, _offer("nobody", 4, fp)), timeout_ms=8000)
    assert isinstance(reply, Refuse) and "unknown request id" in reply.reason

    # a real reservation, then a truncated and a wrong-shape payload: both refused, and the
    # reservation ends with an error when the transfer times out; the blocks come back
    prompt = PROMPTS[-1]
    dec.add_request(dec.make_request(prompt, greedy(splitwise={"remote_prefill": True}), request_id="t0"))
    dec.step()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(peer)
    try:
        s.send_multipart(seal(SECRET, _offer("t0", len(prompt), fp)))
        deadline = time.monotonic() + 10
        while not s.poll(1):
            assert time.monotonic() < deadline
            dec.step()
        acc = _decode_reply(s.recv_multipart())
        assert isinstance(acc, Accept) and acc.num_tokens == len(prompt) - 1
        assert dec.kv_cache.num_free_blocks < dec.kv_cache.num_blocks        # reserved
        frame = np.zeros((2, 2, acc.num_tokens, 16), np.float32).tobytes()
        head = Blocks(PROTOCOL_VERSION, "t0", 1, acc.nonce, acc.block_ids, acc.start, acc.num_tokens, len(frame))
        for payload in ([frame, frame[:-4]], [frame], [frame, frame, frame]):
            s.send_multipart(seal(SECRET, head, payload))
            while not s.poll(1):
                dec.step()
            assert isinstance(_decode_reply(s.recv_multipart()), Refuse)
    finally:
        s.close()
    done = run(dec)
    r = done[(id(dec), "t0")]
    assert r.status is RequestStatus.FINISHED_ABORTED and "did not complete" in r.stop_reason
    assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks
    assert dec.connector.stats()["splitwise_messages_rejected"] - before == len(cases) + 1 + 3

    # and the connector still works
    got = disaggregated(pre, dec, peer, PROMPTS[1:3], "after")
    assert all(r.status is RequestStatus.FINISHED_LENGTH and len(r.output_token_ids) == MAX_TOKENS
               for r in got.values())


def _prefill_until_sent(pre, prompt, peer, rid):
    """Run the prefill side until it has sent its offer (its send thread is under way)."""
    pre.add_request(pre.make_request(prompt, greedy(1, splitwise={"remote_decode": peer}), request_id=rid))
    while pre.connector.counters["splitwise_transfers_sent"] == 0 and pre.has_unfinished():
        pre.step()
        if any(t.name == "splitwise-send" and t.is_alive() for t in pre.connector.threads):
            return


def _assert_equals_mixed(mixed, pre, dec, prompt, rid):
    """Step the pair until done; the decode side's request equals the mixed engine's, every block back."""
    got = {r_id: r for (eid, r_id), r in run(pre, dec).items() if eid == id(dec)}
    mixed.add_request(mixed.make_request(prompt, greedy(), request_id="m-" + rid))
    ref = run(mixed)[(id(mixed), "m-" + rid)]
    assert got[rid].status is RequestStatus.FINISHED_LENGTH, got[rid].stop_reason
    assert got[rid].output_token_ids == ref.output_token_ids
    assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks
    assert pre.kv_cache.num_free_blocks == pre.kv_cache.num_blocks


def test_an_offer_that_comes_while_the_decode_engine_is_in_a_long_step_is_taken(engines):
    """Replays CI's failure: the router opens the decode request, then the
    prefill; the decode engine, in a step that ran past ``unknown_grace_s``
    (2 s) before it took the request in, refused the offer as "unknown
    request id" and the request then waited for an offer that never came
    (503 "no KV offer ... within 30 s")."""
    mixed, pre, dec, peer = engines
    prompt = PROMPTS[3]
    _prefill_until_sent(pre, prompt, peer, "long0")
    time.sleep(2.6)                                  # the decode engine is busy: no step, nothing taken in
    dec.add_request(dec.make_request(prompt, greedy(splitwise={"remote_prefill": True}), request_id="long0"))
    _assert_equals_mixed(mixed, pre, dec, prompt, "long0")


def test_an_offer_refused_before_its_request_came_ends_the_request_at_once(engines):
    """Replays CI's other failure: an offer from another model reached the
    decode instance before the router's decode request did; the offer was
    refused, and the request, queued a moment later, waited out the whole
    transfer timeout for an offer that had come (503 after 30 s, where the
    router should have retried another decode instance at once)."""
    mixed, pre, dec, peer = engines
    fp = {**dec.connector.fingerprint, "model": "another"}
    reply = _ask(peer, seal(SECRET, _offer("early0", 17, fp)))
    assert isinstance(reply, Refuse) and "another model" in reply.reason
    t0 = time.monotonic()
    dec.add_request(dec.make_request(PROMPTS[3], greedy(splitwise={"remote_prefill": True}), request_id="early0"))
    r = run(dec)[(id(dec), "early0")]
    assert r.status is RequestStatus.FINISHED_ABORTED and "another model" in r.stop_reason, r.stop_reason
    assert time.monotonic() - t0 < dec.connector.timeout
    assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks


@pytest.mark.slow
def test_an_offer_for_a_request_queued_behind_a_full_batch_is_taken(tiny_checkpoints, engines):
    """A decode instance whose batch is full (max_num_seqs 1 here) does not
    reach a queued request in its admission loop; before the fix that
    request was unknown to the connector and its offer was refused after
    2 s, so it failed after the transfer timeout."""
    mixed, pre, _, _ = engines
    port = free_port()
    dec = EngineCore(FdxConfig.build(model=str(tiny_checkpoints["LlamaForCausalLM"][0]), max_model_len=128,
                                     block_size=16, num_kv_blocks=24, max_num_seqs=1,
                                     splitwise={"connector_secret": SECRET, "transfer_timeout_s": 6.0,
                                                "role": "decode", "connector_port": port}), progress=False)
    try:
        dec.add_request(dec.make_request(PROMPTS[1], greedy(100), request_id="busy"))
        dec.step()                                   # running: the batch is full
        prompt = PROMPTS[4]
        dec.add_request(dec.make_request(prompt, greedy(splitwise={"remote_prefill": True}), request_id="q0"))
        _prefill_until_sent(pre, prompt, f"tcp://127.0.0.1:{port}", "q0")
        until = time.monotonic() + 2.6              # the busy request runs on, slowly, past the grace
        while time.monotonic() < until:
            assert dec.has_unfinished()
            dec.step()
            time.sleep(0.03)
        dec.abort_request("busy")                    # the batch has room now
        _assert_equals_mixed(mixed, pre, dec, prompt, "q0")
    finally:
        dec.shutdown()


@pytest.mark.slow
def test_a_dead_peer_frees_the_prefill_blocks_and_a_missing_offer_ends_the_request(engines):
    mixed, pre, dec, peer = engines
    dead = f"tcp://127.0.0.1:{free_port()}"
    pre.add_request(pre.make_request(PROMPTS[-1], greedy(1, splitwise={"remote_decode": dead}), request_id="d0"))
    failed = pre.connector.stats()["splitwise_transfers_failed"]
    run(pre)                                   # steps until the held blocks come back (after the timeout)
    assert pre.kv_cache.num_free_blocks == pre.kv_cache.num_blocks
    assert pre.connector.stats()["splitwise_transfers_failed"] == failed + 1

    dec.add_request(dec.make_request(PROMPTS[2], greedy(splitwise={"remote_prefill": True}), request_id="d1"))
    r = run(dec)[(id(dec), "d1")]
    assert r.status is RequestStatus.FINISHED_ABORTED and "no KV offer" in r.stop_reason
    assert dec.kv_cache.num_free_blocks == dec.kv_cache.num_blocks


@pytest.mark.slow
def test_an_id_held_for_a_transfer_is_refused_and_a_retry_under_another_goes_through(engines):
    """Replays CI's failure: the router's first pairing (to a decode instance of another
    model) was refused, and its retry reached the prefill instance, under the same
    X-Request-Id and so the same engine id, while the first try's blocks were still held
    for its transfer. The engine took it; the first transfer's end freed the blocks under
    that id, the retry finished with none, sent no offer, and the decode side waited 30 s
    (503 "no KV offer from a prefill instance"). Now the engine refuses an id it holds for
    a transfer, and the server names a prefill instance's engine requests apart
    (test_router); the retry under another id goes through."""
    mixed, pre, dec, peer = engines
    prompt = PROMPTS[3]
    dead = f"tcp://127.0.0.1:{free_port()}"             # its transfer holds the blocks until the timeout
    pre.add_request(pre.make_request(prompt, greedy(1, splitwise={"remote_decode": dead}), request_id="dup-0"))
    while "dup-0" not in pre.scheduling.held:
        pre.step()
    again = pre.make_request(prompt, greedy(1, splitwise={"remote_decode": peer}), request_id="dup-0")
    with pytest.raises(ValueError, match="'dup-0' is already in the engine"):
        pre.add_request(again)
    assert "dup-0" in pre.scheduling.held                 # untouched
    tid = {"transfer_id": "retry"}                        # the router's retry: wire id "retry-0" both sides
    dec.add_request(dec.make_request(prompt, greedy(splitwise={"remote_prefill": True, **tid}), request_id="r-0"))
    pre.add_request(pre.make_request(prompt, greedy(1, splitwise={"remote_decode": peer, **tid}),
                                     request_id="dup.1a2b3c-0"))
    _assert_equals_mixed(mixed, pre, dec, prompt, "r-0")  # (steps until the held blocks are back too)


def test_the_deployment_page_configs_are_valid(tmp_path):
    import pathlib
    import re
    page = (pathlib.Path(__file__).parent.parent / "docs" / "deployment.md").read_text()
    configs = re.findall(r"`(\w+\.yaml)` on host \w:\n\n```yaml\n(.*?)```", page, re.S)
    assert [name for name, _ in configs] == ["prefill.yaml", "decode.yaml"]
    roles = []
    for name, text in configs:
        (tmp_path / name).write_text(text)
        cfg = FdxConfig.build(str(tmp_path / name))
        assert cfg.cache.kv_connector == "splitwise"
        roles.append(cfg.plugins["connector"]["splitwise"]["role"])
    assert roles == ["prefill", "decode"]
    for i, text in enumerate(re.findall(r"```yaml\n(.*?)```", page, re.S)):   # the global scheduler's too
        (tmp_path / f"{i}.yaml").write_text(text)
        FdxConfig.build(str(tmp_path / f"{i}.yaml"))
    old = FdxConfig.build(splitwise_role="decode")     # the deprecated key, mapped to the new place
    assert old.cache.kv_connector == "splitwise" and old.plugins["connector"]["splitwise"] == {"role": "decode"}


def test_decode_role_needs_a_port_and_bad_settings_name_the_key(tiny_checkpoints):
    from fdx.core.config import ConfigError
    model = str(tiny_checkpoints["LlamaForCausalLM"][0])
    with pytest.raises(ConfigError, match=r"plugins\.connector\.splitwise.*port must be set"):
        EngineCore(FdxConfig.build(model=model, max_model_len=64, splitwise_role="decode"), progress=False)
    with pytest.raises(ConfigError, match="plugins.connector.splitwise.*bogus"):
        EngineCore(FdxConfig.build(model=model, max_model_len=64, splitwise_role="prefill",
                                   plugins={"connector": {"splitwise": {"bogus": 1}}}), progress=False)
    with pytest.raises(ConfigError, match="plugins.connector.splitwise.*curve_server_key.*Z85"):
        EngineCore(FdxConfig.build(model=model, max_model_len=64, splitwise_role="prefill",
                                   plugins={"connector": {"splitwise": {"curve_server_key": "short"}}}),
                   progress=False)
    from fdx.core.assembly import Assembly
    from fdx.core.plugins import get_plugin_manager
    with pytest.raises(ConfigError, match=r"plugins\.connector\.splitwise\.role"):
        Assembly(FdxConfig.build(splitwise_role="both"), get_plugin_manager())
