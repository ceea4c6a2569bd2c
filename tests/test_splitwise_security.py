"""The splitwise channel under attack (issue 21): an on-path proxy between a
real prefill and a real decode engine (loopback TCP) alters, swaps, replays
and re-sends messages, strangers without the secret send forged ones and an
oversized frame; every such message is refused and no request is answered
from the wrong context. The proxy and the forged messages work on raw ZMQ
frames, so these tests also run against the v1 wire (and fail there)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq

from serve_utils import free_port
from splitwise_utils import greedy as _greedy
from splitwise_utils import run

from fdx.core.config import FdxConfig
from fdx.core.engine import EngineCore
from fdx.core.request import RequestStatus

pytestmark = pytest.mark.slow

SECRET = "s3cret"
MAX_TOKENS = 5
PROMPT_C = list(range(100, 117))             # two prompts of the same length (17 tokens),
PROMPT_D = list(range(300, 317))             # so one's KV fits the other's reservation
PROMPT_E = list(range(500, 517))
COMMON = dict(max_model_len=128, block_size=16, num_kv_blocks=24)


def _pair(model: str, pre_settings: dict | None = None, dec_settings: dict | None = None):
    port = free_port()
    sw = {"connector_secret": SECRET, "transfer_timeout_s": 3.0}

    def plugins(settings):
        return {"plugins": {"connector": {"splitwise": settings}}} if settings else {}
    pre = EngineCore(FdxConfig.build(model=model, **COMMON, splitwise={**sw, "role": "prefill"},
                                     **plugins(pre_settings)), progress=False)
    dec = EngineCore(FdxConfig.build(model=model, **COMMON, **plugins(dec_settings),
                                     splitwise={**sw, "role": "decode", "connector_port": port}), progress=False)
    return pre, dec, f"tcp://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints["LlamaForCausalLM"][0])


@pytest.fixture(scope="module")
def refs(model):
    mixed = EngineCore(FdxConfig.build(model=model, **COMMON), progress=False)
    for name, p in (("C", PROMPT_C), ("D", PROMPT_D), ("E", PROMPT_E)):
        mixed.add_request(mixed.make_request(p, greedy(), request_id=name))
    out = {rid: r.output_token_ids for (_, rid), r in run(mixed).items()}
    mixed.shutdown()
    return out


@pytest.fixture(scope="module")
def engines(model):
    pre, dec, peer = _pair(model)
    yield pre, dec, peer
    pre.shutdown()
    dec.shutdown()


def greedy(max_tokens=MAX_TOKENS, **extra):
    return _greedy(max_tokens, **extra)



def transfer(pre, dec, peer: str, prompt: list[int], rid: str, tid: str | None = None):
    """One request through the pair (the prefill side sends to ``peer``): the decode side's result."""
    dec.add_request(dec.make_request(prompt, greedy(splitwise={"remote_prefill": True, "transfer_id": tid}),
                                     request_id=rid))
    pre.add_request(pre.make_request(prompt, greedy(1, splitwise={"remote_decode": peer, "transfer_id": tid}),
                                     request_id=rid))
    return run(pre, dec)[(id(dec), rid)]


def rejected(dec) -> float:
    return dec.connector.stats()["splitwise_messages_rejected"]


def all_blocks_free(*engines) -> bool:
    return all(e.kv_cache.num_free_blocks == e.kv_cache.num_blocks for e in engines)


# -- the attacker's tools: raw frames, whatever the wire version --------------------------------

def header_at(frames: list[bytes]) -> int:
    """The index of the msgpack header among a message's frames (0 on the v1 wire, 1 after a MAC)."""
    for i, f in enumerate(frames[:2]):
        try:
            head = msgspec.msgpack.decode(f)
        except msgspec.DecodeError:
            continue
        if isinstance(head, dict) and "type" in head:
            return i
    raise AssertionError("no header frame")


def header(frames: list[bytes]) -> dict:
    return msgspec.msgpack.decode(frames[header_at(frames)])


def edit(frames: list[bytes], **fields) -> list[bytes]:
    """The same frames (MAC included) with header fields changed."""
    i = header_at(frames)
    return [*frames[:i], msgspec.msgpack.encode({**header(frames), **fields}), *frames[i + 1:]]


def with_payload(frames: list[bytes], payload: list[bytes]) -> list[bytes]:
    return frames[:header_at(frames) + 1] + payload


def payload_of(frames: list[bytes]) -> list[bytes]:
    return frames[header_at(frames) + 1:]


class Dealer:
    """A second connection to the decode connector: the attacker's own."""

    def __init__(self, peer: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(peer)

    def ask(self, frames: list[bytes], timeout_s: float = 3.0, step=None) -> dict | None:
        """Send; the reply's header (None if none came), stepping ``step`` while waiting.
        A send that cannot leave by the deadline (no connection: a refused CURVE
        handshake leaves none, and a DEALER's send then blocks) is None too."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() >= deadline:
                    return None
                time.sleep(0.01)
        while time.monotonic() < deadline:
            if self.sock.poll(5):
                return header(self.sock.recv_multipart())
            if step is not None and step.has_unfinished():
                step.step()
        return None

    def close(self):
        self.sock.close()


class Proxy:
    """An on-path attacker: a ZMQ ROUTER the prefill side sends to, forwarding
    each message to the real decode connector and back; ``tamper(direction,
    frames)`` ("up": to decode, "down": to prefill) may change it."""

    def __init__(self, backend: str, tamper=None):
        self.backend, self.tamper = backend, tamper or (lambda direction, frames: frames)
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        port = free_port()
        self.front.bind(f"tcp://127.0.0.1:{port}")
        self.address = f"tcp://127.0.0.1:{port}"
        self.seen: list[tuple[str, list[bytes]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        poller, backs, owners = zmq.Poller(), {}, {}
        poller.register(self.front, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(10):
                if sock is self.front:
                    ident, *frames = self.front.recv_multipart()
                    if ident not in backs:
                        back = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.backend)
                        backs[ident], owners[back] = back, ident
                        poller.register(back, zmq.POLLIN)
                    self._forward("up", frames, backs[ident].send_multipart)
                else:
                    ident = owners[sock]
                    self._forward("down", sock.recv_multipart(),
                                  lambda f, ident=ident: self.front.send_multipart([ident, *f]))
        for back in backs.values():
            back.close()
        self.front.close()

    def _forward(self, direction: str, frames: list[bytes], send):
        self.seen.append((direction, frames))
        out = self.tamper(direction, frames)
        if out is not None:
            send(out)

    def kinds(self, direction: str) -> list[str]:
        return [header(f)["type"] for d, f in self.seen if d == direction]

    def message(self, direction: str, kind: str) -> list[bytes]:
        return next(f for d, f in self.seen if d == direction and header(f)["type"] == kind)

    def close(self):
        self.stop.set()
        self.thread.join(timeout=5)
        self.ctx.term()


def is_kind(frames: list[bytes], kind: str) -> bool:
    try:
        return header(frames)["type"] == kind
    except AssertionError:
        return False


# -- (a) another transfer's KV swapped in ---------------------------------------------------------

def test_a_swapped_payload_is_refused_and_the_victim_fails_cleanly(engines, refs):
    """Chosen behaviour: the victim's request ends (finish reason abort, a
    ``splitwise:`` stop reason) at once, on the prefill side's authenticated
    Abort; it is never answered from the other context. The router retries a
    request refused before any output on another decode instance; a retry
    through the same attacker would gain nothing."""
    pre, dec, peer = engines
    recorder = Proxy(peer)
    try:
        assert transfer(pre, dec, recorder.address, PROMPT_D, "a-d").output_token_ids == refs["D"]
        stolen = payload_of(recorder.message("up", "blocks"))
    finally:
        recorder.close()
    before = rejected(dec)
    proxy = Proxy(peer, lambda d, f: with_payload(f, stolen) if d == "up" and is_kind(f, "blocks") else f)
    try:
        r = transfer(pre, dec, proxy.address, PROMPT_C, "a-c")
    finally:
        proxy.close()
    assert r.status is RequestStatus.FINISHED_ABORTED, r.output_token_ids
    assert "splitwise" in r.stop_reason
    assert rejected(dec) > before
    assert all_blocks_free(pre, dec)


# -- (b) a recorded transfer replayed under a new request -----------------------------------------

def test_b_a_recorded_transfer_replayed_for_a_new_request_is_refused(engines, refs):
    pre, dec, peer = engines
    recorder = Proxy(peer)
    try:
        assert transfer(pre, dec, recorder.address, PROMPT_D, "b-d-0", tid="T").output_token_ids == refs["D"]
        offer, blocks = recorder.message("up", "offer"), recorder.message("up", "blocks")
    finally:
        recorder.close()
    # a new request that names the same transfer (a client chooses its transfer id)
    dec.add_request(dec.make_request(PROMPT_E, greedy(splitwise={"remote_prefill": True, "transfer_id": "T"}),
                                     request_id="b-e-0"))
    dec.step()
    before = rejected(dec)
    attacker = Dealer(peer)
    try:
        reply = attacker.ask(offer, step=dec)
        assert reply is not None and reply["type"] == "refuse", reply
        reply = attacker.ask(blocks, step=dec)
        assert reply is not None and reply["type"] == "refuse", reply
    finally:
        attacker.close()
    assert rejected(dec) - before == 2
    # the genuine prefill then serves it, from its own context
    pre.add_request(pre.make_request(PROMPT_E, greedy(1, splitwise={"remote_decode": peer, "transfer_id": "T"}),
                                     request_id="b-e-0"))
    r = run(pre, dec)[(id(dec), "b-e-0")]
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == refs["E"]
    assert all_blocks_free(pre, dec)


# -- (c) a genuine header re-sent from a second connection -----------------------------------------

def test_c_a_resent_header_from_a_second_connection_is_refused_and_the_transfer_goes_on(engines, refs):
    pre, dec, peer = engines
    replies = []

    def race(direction, frames):
        if direction == "up" and is_kind(frames, "blocks"):
            attacker = Dealer(peer)
            try:
                zeroed = [bytes(len(f)) for f in payload_of(frames)]
                replies.append(attacker.ask(with_payload(frames, zeroed), timeout_s=2))
                replies.append(attacker.ask(frames, timeout_s=2))      # the genuine message itself
            finally:
                attacker.close()
        return frames

    before = rejected(dec)
    proxy = Proxy(peer, race)
    try:
        r = transfer(pre, dec, proxy.address, PROMPT_C, "c-c")
    finally:
        proxy.close()
    assert [x and x["type"] for x in replies] == ["refuse", "refuse"], replies
    assert rejected(dec) - before == 2
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == refs["C"]
    assert all_blocks_free(pre, dec)


# -- (d) forged offers and aborts naming a live request --------------------------------------------

def _forgeries(rid: str, fp: dict) -> list[list[bytes]]:
    enc = msgspec.msgpack.encode
    return [
        # the v1 wire's offer with a wrong auth
        [enc({"type": "offer", "v": 1, "request_id": rid, "num_tokens": 4, "first_token": 1,
              "fingerprint": fp, "auth": "0" * 64})],
        # the v2 wire's offer and abort, sealed under a wrong secret
        [b"\0" * 32, enc({"type": "offer", "v": 2, "request_id": rid, "seq": 0, "offer_nonce": "00",
                          "sent_at": time.time(), "num_tokens": 4, "first_token": 1, "fingerprint": fp})],
        [b"\0" * 32, enc({"type": "abort", "v": 2, "request_id": rid, "seq": 5, "nonce": "00",
                          "reason": "forged"})],
    ]


def test_d_forged_offers_and_aborts_do_not_end_a_live_request(engines, refs):
    pre, dec, peer = engines
    fp = dict(dec.connector.fingerprint)
    dec.add_request(dec.make_request(PROMPT_C, greedy(splitwise={"remote_prefill": True}), request_id="d-c"))
    dec.step()
    before = rejected(dec)
    attacker = Dealer(peer)
    try:
        for frames in _forgeries("d-c", fp):                 # while the request waits for its offer
            reply = attacker.ask(frames, step=dec)
            assert reply is not None and reply["type"] == "refuse", reply

        def mid_transfer(direction, frames):                 # and once its blocks are reserved
            if direction == "down" and is_kind(frames, "accept"):
                for forged in _forgeries("d-c", fp):
                    attacker.sock.send_multipart(forged)
                time.sleep(0.3)
            return frames
        proxy = Proxy(peer, mid_transfer)
        try:
            pre.add_request(pre.make_request(PROMPT_C, greedy(1, splitwise={"remote_decode": proxy.address}),
                                             request_id="d-c"))
            r = run(pre, dec)[(id(dec), "d-c")]
        finally:
            proxy.close()
    finally:
        attacker.close()
    assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == refs["C"], r.stop_reason
    assert rejected(dec) - before == 6
    assert all_blocks_free(pre, dec)


# -- (e) an oversized frame --------------------------------------------------------------------------

SEND_BIG = """
import sys, time, zmq
s = zmq.Context().socket(zmq.DEALER)
s.connect(sys.argv[1])
s.send_multipart([bytes(32), b"\\x80", bytes(int(sys.argv[2]))])
time.sleep(float(sys.argv[3]))
"""


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_e_a_frame_past_the_limit_is_dropped_before_it_is_allocated(engines, refs):
    pre, dec, peer = engines
    size = 256 << 20
    base, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        subprocess.run([sys.executable, "-c", SEND_BIG, peer, str(size), "3"], check=True, timeout=60)
    finally:
        stop.set()
        sampler.join()
    assert peak[0] - base < size // 4, f"the receiver grew by {(peak[0] - base) >> 20} MiB"
    assert dec.connector.frame_limit() < size
    assert transfer(pre, dec, peer, PROMPT_C, "e-c").output_token_ids == refs["C"]   # it still works


# -- (f) a tampered first token or block id ------------------------------------------------------------

@pytest.mark.parametrize("direction,kind,change", [
    ("up", "offer", lambda h: {"first_token": h["first_token"] + 1}),
    ("up", "blocks", lambda h: {"block_ids": h["block_ids"][::-1]}),
    ("down", "accept", lambda h: {"block_ids": h["block_ids"][::-1]}),
], ids=["first-token", "blocks-block-ids", "accept-block-ids"])
def test_f_a_tampered_first_token_or_block_id_is_refused(engines, direction, kind, change):
    pre, dec, peer = engines
    differ = dec.connector.stats()["splitwise_first_token_differ"]
    received = dec.connector.stats()["splitwise_transfers_received"]

    def tamper(d, frames):
        return edit(frames, **change(header(frames))) if d == direction and is_kind(frames, kind) else frames
    proxy = Proxy(peer, tamper)
    try:
        r = transfer(pre, dec, proxy.address, PROMPT_D, f"f-{kind}-{direction}")
    finally:
        proxy.close()
    assert r.status is RequestStatus.FINISHED_ABORTED and "splitwise" in r.stop_reason
    s = dec.connector.stats()
    assert s["splitwise_transfers_received"] == received and s["splitwise_first_token_differ"] == differ
    assert all_blocks_free(pre, dec)


# -- CURVE ----------------------------------------------------------------------------------------------

def test_curve_encrypts_the_channel_and_keeps_out_clients_without_the_server_key(model, refs):
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    public, secret = zmq.curve_keypair()
    pre, dec, peer = _pair(model, {"curve_server_key": public.decode()}, {"curve_secret_key": secret.decode()})
    try:
        r = transfer(pre, dec, peer, PROMPT_C, "curve-c")
        assert r.status is RequestStatus.FINISHED_LENGTH and r.output_token_ids == refs["C"]
        assert dec.connector.stats()["splitwise_transfers_received"] == 1
        plain = Dealer(peer)                                  # no CURVE at all: the handshake fails
        try:
            assert plain.ask([b"\x00\xffgarbage"], timeout_s=1.5) is None
        finally:
            plain.close()
        wrong = Dealer.__new__(Dealer)                        # CURVE, but another server key
        wrong.sock = zmq.Context.instance().socket(zmq.DEALER)
        wrong.sock.setsockopt(zmq.LINGER, 0)
        wrong.sock.curve_serverkey = zmq.curve_keypair()[0]
        wrong.sock.curve_publickey, wrong.sock.curve_secretkey = zmq.curve_keypair()
        wrong.sock.connect(peer)
        try:
            assert wrong.ask([b"\x00\xffgarbage"], timeout_s=1.5) is None
        finally:
            wrong.close()
        assert dec.connector.stats()["splitwise_messages_rejected"] == 0   # nothing got through to be refused
    finally:
        pre.shutdown()
        dec.shutdown()
