"""splitwise: prefill/decode disaggregation on the KV connector seam.

An instance runs as ``splitwise.role``: ``mixed`` (no connector), ``prefill``
or ``decode``. The router (core/serving/router.py) opens each request on a
decode instance first, marked ``extra_args: {"splitwise": {"remote_prefill":
true}}``; that request waits in the queue (``defer_request``). Then it sends
the same request to a prefill instance with ``max_tokens: 1`` and
``{"splitwise": {"remote_decode": "tcp://<decode connector>"}}``. The prefill
instance computes the prompt and the first token; when the request finishes
its blocks are held (``request_finished`` returns True) and moved:

    prefill (DEALER)                               decode (ROUTER, bound)
    Offer(request_id, num_tokens, first_token) --> match the waiting request,
                                                   allocate its blocks
                   <-- Accept(block_ids, start, num_tokens) | Refuse(reason)
    Blocks(block_ids, start, num_tokens)       --> checked, written into the
      + one frame per layer                        reserved blocks (engine thread)
                   <-- Confirm | Refuse
    free the blocks (get_finished()[0])            the request joins the batch
                                                   (get_finished()[1])

The decode side loads the prompt's KV except its last token and computes
that one position itself, sampling the first token (as vLLM's NIXL
connector does): the client's one stream comes from the decode instance and
no token is repeated or lost. The prefill side's first token rides in the
Offer; with greedy decoding the two agree (counted in ``stats()``).

Payload: after the header, one frame per layer, each ``[2 (k, v),
num_kv_heads, num_tokens, head_dim]`` in the cache dtype. Chunked by layer,
not streamed layer by layer: the prefill side sends once the request's
prompt is computed (the engine does not pause a forward to send), and a
frame per layer keeps each buffer a contiguous slice that the receiver
checks on its own (its size against the fingerprint) before writing any.

Every header is a tagged msgspec struct in msgpack (never pickle) carrying
``v`` (``PROTOCOL_VERSION``) and ``auth``: an HMAC-SHA256 of the message
kind and request id under the shared secret (``connector_secret``), so the
secret itself never travels (a prefill instance sends to whatever address
its request names: only the router should reach its API). Anything that
does not decode, has another version, a wrong ``auth``, an
unknown request id, block ids or counts other than those reserved, or a
fingerprint (layers, KV heads, head dim, dtype, model name) other than the
receiver's is refused and logged; the connector keeps running. A step not
answered within ``transfer_timeout_s`` (or a dead peer) fails the transfer:
the prefill side frees its blocks, the decode side ends the request with an
error and frees its blocks.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import KVConnector
from fdx.core.request import RequestStatus

log = logging.getLogger("fdx.cache.splitwise")

PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 1 << 16
POLL_MS = 10


# -- the wire messages -------------------------------------------------------------------

class Offer(msgspec.Struct, tag="offer"):
    v: int
    request_id: str
    num_tokens: int                          # tokens whose KV the prefill side holds
    first_token: int                         # the token the prefill side sampled
    fingerprint: dict[str, str | int]
    auth: str = ""                           # sign(secret, kind, request_id)


class Blocks(msgspec.Struct, tag="blocks"):
    v: int
    request_id: str
    block_ids: list[int]                     # the receiver's, as in its Accept
    start: int
    num_tokens: int
    fingerprint: dict[str, str | int]
    auth: str = ""                           # sign(secret, kind, request_id)


class Accept(msgspec.Struct, tag="accept"):
    v: int
    request_id: str
    block_ids: list[int]                     # the decode request's whole block table
    start: int                               # first token position to send
    num_tokens: int                          # how many (0: nothing wanted, done)


class Refuse(msgspec.Struct, tag="refuse"):
    v: int
    request_id: str
    reason: str


class Confirm(msgspec.Struct, tag="confirm"):
    v: int
    request_id: str


ToDecode = Offer | Blocks
ToPrefill = Accept | Refuse | Confirm
_encoder = msgspec.msgpack.Encoder()


def sign(secret: str, kind: str, request_id: str) -> str:
    """The ``auth`` of an Offer ("offer") or Blocks ("blocks") message."""
    return hmac.new(secret.encode(), f"fdx-splitwise:{kind}:{request_id}".encode(), hashlib.sha256).hexdigest()


def _splitwise_args(request) -> dict:
    extra = request.sampling_params.extra_args or {}
    sw = extra.get("splitwise")
    return sw if isinstance(sw, dict) else {}


def wire_id(request) -> str:
    """The id both instances know a request by: ``<transfer_id>-<sequence
    index>`` when the router named the transfer (each server names its own
    engine requests ``<its id>-<index>``), else the engine request id."""
    tid = _splitwise_args(request).get("transfer_id")
    if not tid:
        return request.request_id
    return f"{tid}-{request.request_id.rsplit('-', 1)[-1]}"


@dataclass(slots=True)
class SendJob:
    request_id: str                          # the engine's
    wire_id: str                             # on the wire
    block_ids: list[int]
    num_tokens: int
    first_token: int
    peer: str


@dataclass(slots=True)
class SplitwiseStep:
    """The runner side's work for one step (plain data)."""
    sends: list[SendJob] = field(default_factory=list)
    loads: dict[str, tuple[list[int], int, int]] = field(default_factory=dict)  # id -> (blocks, start, n)
    cancels: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _OfferState:
    identity: bytes
    offer: Offer
    arrived: float


SETTINGS = {"reserve_timeout_s", "unknown_grace_s", "model_name"}


class SplitwiseConnector(KVConnector):
    def __init__(self, config, block_size: int, settings=None):
        super().__init__(config, block_size, settings)
        bad = set(self.settings) - SETTINGS
        if bad:
            raise ValueError(f"unknown setting {sorted(bad)[0]!r}; known: {', '.join(sorted(SETTINGS))}")
        sw = config.splitwise
        self.role = sw.role
        self.secret = sw.connector_secret or ""
        self.timeout = float(sw.transfer_timeout_s)
        self.delay = float(sw.debug_transfer_delay_s)
        self.reserve_timeout = float(self.settings.get("reserve_timeout_s", min(2.0, self.timeout)))
        self.unknown_grace = float(self.settings.get("unknown_grace_s", 2.0))
        model = config.model.model
        self.model_name = str(self.settings.get("model_name") or (Path(model).name if model else "default"))
        self.fingerprint: dict | None = None
        self.lock = threading.Lock()
        # scheduler side (engine thread)
        self.pending_sends: list[SendJob] = []
        self.pending_loads: dict[str, tuple[list[int], int, int]] = {}
        self.pending_cancels: list[str] = []
        self.expected: dict[str, tuple[float, str]] = {}   # decode: waiting requests -> (since, engine id)
        self.offers: dict[str, _OfferState] = {}      # decode: offers received (socket thread writes)
        self.accepted: dict[str, tuple[_OfferState, list[int], int, int, float]] = {}
        self.failed: dict[str, str] = {}
        self.first_tokens: dict[str, int] = {}        # decode: the prefill side's first token, to compare
        # runner side
        self.kv_caches: list | None = None
        self.loading: dict[str, tuple[list[int], int, int]] = {}
        self.arrived: dict[str, list[bytes]] = {}     # decode: payloads checked by the socket thread
        self.done_sending: set[str] = set()
        self.done_recving: set[str] = set()
        self.outgoing: queue.Queue = queue.Queue()    # decode: (identity, frames) for the socket thread
        self.counters = {"splitwise_blocks_sent": 0, "splitwise_bytes_sent": 0, "splitwise_blocks_received": 0,
                         "splitwise_bytes_received": 0, "splitwise_transfers_sent": 0,
                         "splitwise_transfers_received": 0, "splitwise_transfers_failed": 0,
                         "splitwise_messages_rejected": 0, "splitwise_transfer_seconds_sum": 0.0,
                         "splitwise_first_token_agree": 0, "splitwise_first_token_differ": 0}
        self.transfer_times: list[float] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.zctx = zmq.Context()
        self.sock = None
        if self.role == "decode":
            if not sw.connector_port:
                raise ValueError("splitwise.connector_port must be set (non-zero) for role decode")
            self.sock = self.zctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.LINGER, 0)
            try:
                self.sock.bind(f"tcp://{sw.connector_host}:{sw.connector_port}")
            except zmq.ZMQError as e:
                self.sock.close()
                raise ValueError(f"cannot listen on {sw.connector_host}:{sw.connector_port}: {e}") from None
            t = threading.Thread(target=self._serve, name="splitwise-decode", daemon=True)
            t.start()
            self.threads.append(t)

    # -- scheduler side: decode ----------------------------------------------------------
    def defer_request(self, request) -> bool:
        if not _splitwise_args(request).get("remote_prefill"):
            return False
        rid, key, now = request.request_id, wire_id(request), time.monotonic()
        with self.lock:
            since = self.expected.setdefault(key, (now, rid))[0]
            st = self.offers.get(key)
        if st is None:
            if now - since > self.timeout:
                self.failed[rid] = f"splitwise: no KV offer from a prefill instance within {self.timeout:g} s"
            return True
        if self._loadable(request, request.num_computed_tokens, st.offer) <= 0:
            with self.lock:                             # nothing worth loading: computed here
                self.offers.pop(key, None)
            self._reply(st.identity, Accept(PROTOCOL_VERSION, key, [], 0, 0))
            return False
        if now - st.arrived > self.reserve_timeout:     # offered, but no blocks freed up in time
            with self.lock:
                self.offers.pop(key, None)
            self._reply(st.identity, Refuse(PROTOCOL_VERSION, key, "no free KV blocks"))
            self.failed[rid] = "splitwise: refused: no free KV blocks for the transfer"
            self.counters["splitwise_transfers_failed"] += 1
            return True
        return False

    @staticmethod
    def _loadable(request, num_computed: int, offer: Offer) -> int:
        return min(offer.num_tokens, request.num_prompt_tokens - 1) - num_computed

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        st = self.offers.get(wire_id(request))
        if st is None or not _splitwise_args(request).get("remote_prefill"):
            return 0
        return max(0, self._loadable(request, num_computed_tokens, st.offer))

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        rid, key = request.request_id, wire_id(request)
        with self.lock:
            st = self.offers.pop(key, None)
        if st is None:
            return
        start = request.num_computed_tokens
        self.accepted[key] = (st, list(block_ids), start, num_external_tokens, time.monotonic(), rid)
        self.pending_loads[key] = (list(block_ids), start, num_external_tokens)
        if st.offer.first_token >= 0:
            self.first_tokens[rid] = st.offer.first_token
        self._reply(st.identity, Accept(PROTOCOL_VERSION, key, list(block_ids), start, num_external_tokens))

    def load_async(self, request) -> bool:
        return wire_id(request) in self.accepted

    def take_failed(self) -> dict[str, str]:
        now = time.monotonic()
        for st, _, _, _, since, rid in list(self.accepted.values()):
            if now - since > self.timeout:
                self.failed[rid] = (f"splitwise: the KV transfer from the prefill instance did not complete "
                                    f"within {self.timeout:g} s")
                self.counters["splitwise_transfers_failed"] += 1
        with self.lock:
            out, self.failed = self.failed, {}
        return out

    # -- scheduler side: both ---------------------------------------------------------------
    def request_finished(self, request, block_ids: list[int]) -> bool:
        rid, key = request.request_id, wire_id(request)
        with self.lock:
            self.expected.pop(key, None)
            st = self.offers.pop(key, None)
        if st is not None:
            self._reply(st.identity, Refuse(PROTOCOL_VERSION, key, "the decode request ended"))
        acc = self.accepted.pop(key, None)
        if acc is not None:
            self.pending_loads.pop(key, None)
            self.pending_cancels.append(key)
            self._reply(acc[0].identity, Refuse(PROTOCOL_VERSION, key, "the decode request ended"))
        first_p = self.first_tokens.pop(rid, None)
        if first_p is not None and request.output_token_ids:
            agree = request.output_token_ids[0] == first_p
            self.counters["splitwise_first_token_agree" if agree else "splitwise_first_token_differ"] += 1
        peer = _splitwise_args(request).get("remote_decode")
        if not peer or request.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return False
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        first = request.output_token_ids[0] if request.output_token_ids else -1
        self.pending_sends.append(SendJob(rid, key, list(block_ids), n, int(first), str(peer)))
        return True

    def build_connector_meta(self) -> SplitwiseStep:
        step = SplitwiseStep(self.pending_sends, self.pending_loads, self.pending_cancels)
        self.pending_sends, self.pending_loads, self.pending_cancels = [], {}, []
        return step

    # -- runner side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layout) -> None:
        self.kv_caches, self.spec = kv_caches, layout
        dtype = str(kv_caches[0][0].dtype).replace("paddle.", "") if kv_caches else layout.dtype
        self.dtype = np.dtype({"float32": "float32", "float16": "float16"}.get(dtype, "float32"))
        self.fingerprint = {"model": self.model_name, "num_layers": layout.num_layers,
                            "num_kv_heads": layout.num_kv_heads, "head_dim": layout.head_dim, "dtype": dtype}

    def _rows(self, block_ids: list[int], start: int, n: int) -> np.ndarray:
        bs = self.spec.block_size
        pos = np.arange(start, start + n)
        slot = np.asarray(block_ids, dtype=np.int64)[pos // bs] * bs + pos % bs
        return self.spec.kv_rows(slot).reshape(-1)       # [num_kv_heads, n], whatever the layout

    def _read(self, job: SendJob) -> list[np.ndarray]:
        import paddle
        idx = paddle.to_tensor(self._rows(job.block_ids, 0, job.num_tokens))
        shape = [2, self.spec.num_kv_heads, job.num_tokens, self.spec.head_dim]
        view = self.spec.row_view
        return [np.ascontiguousarray(paddle.stack([paddle.gather(view(k), idx), paddle.gather(view(v), idx)])
                                     .numpy().reshape(shape)) for k, v in self.kv_caches]

    def _write(self, block_ids: list[int], start: int, n: int, frames: list[bytes]) -> None:
        import paddle
        idx = paddle.to_tensor(self._rows(block_ids, start, n))
        rows = self.spec.num_kv_heads * n
        for (k, v), frame in zip(self.kv_caches, frames):
            arr = np.frombuffer(frame, dtype=self.dtype).reshape(2, rows, self.spec.head_dim)
            self.spec.row_view(k).scatter_(idx, paddle.to_tensor(arr[0]), overwrite=True)
            self.spec.row_view(v).scatter_(idx, paddle.to_tensor(arr[1]), overwrite=True)

    def start_load_kv(self, metadata: SplitwiseStep | None) -> None:
        if metadata is None or self.kv_caches is None:
            return
        for job in metadata.sends:
            data = self._read(job)
            t = threading.Thread(target=self._send_transfer, args=(job, data), name="splitwise-send", daemon=True)
            t.start()
            self.threads = [x for x in self.threads if x.is_alive()] + [t]
        self.loading.update(metadata.loads)
        for rid in metadata.cancels:
            self.loading.pop(rid, None)
        with self.lock:
            arrived, self.arrived = self.arrived, {}
        for key, frames in arrived.items():
            spec = self.loading.pop(key, None)
            acc = self.accepted.pop(key, None)
            if spec is None or acc is None:
                continue                                  # the request ended meanwhile
            block_ids, start, n = spec
            self._write(block_ids, start, n, frames)
            self.done_recving.add(acc[5])
            nbytes = sum(len(f) for f in frames)
            c = self.counters
            c["splitwise_blocks_received"] += -(-(start + n) // self.block_size) - start // self.block_size
            c["splitwise_bytes_received"] += nbytes
            c["splitwise_transfers_received"] += 1
            self._record_time(time.monotonic() - acc[4])
            self._reply(acc[0].identity, Confirm(PROTOCOL_VERSION, key))

    def get_finished(self) -> tuple[set[str], set[str]]:
        with self.lock:
            sending, self.done_sending = self.done_sending, set()
        recving, self.done_recving = self.done_recving, set()
        return sending, recving

    def _record_time(self, seconds: float) -> None:
        with self.lock:
            self.counters["splitwise_transfer_seconds_sum"] += seconds
            self.transfer_times.append(seconds)

    def stats(self) -> dict[str, float]:
        with self.lock:
            out = {k: float(v) for k, v in self.counters.items()}
            times = list(self.transfer_times)
        out["splitwise_transfer_seconds_count"] = float(len(times))
        for le in TIME_BUCKETS:
            out[f"splitwise_transfer_seconds_le_{le:g}"] = float(sum(t <= le for t in times))
        return out

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        self.zctx.term() if not self.zctx.closed else None
        self.kv_caches = None

    # -- prefill side: one transfer, on its own thread -----------------------------------------
    def _send_transfer(self, job: SendJob, data: list[np.ndarray]) -> None:
        t0 = time.monotonic()
        sock = self.zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        ok, why = False, ""
        decoder = msgspec.msgpack.Decoder(ToPrefill)
        try:
            sock.connect(job.peer)
            sock.send(_encoder.encode(Offer(PROTOCOL_VERSION, job.wire_id, job.num_tokens, job.first_token,
                                            self.fingerprint or {}, sign(self.secret, "offer", job.wire_id))))
            reply = self._await(sock, decoder, job.wire_id)
            if isinstance(reply, Accept):
                if reply.num_tokens == 0:
                    ok = True
                elif reply.start < 0 or reply.start + reply.num_tokens > job.num_tokens:
                    why = f"the decode side asked for tokens {reply.start}..{reply.start + reply.num_tokens}"
                else:
                    if self.delay:
                        self.stop.wait(self.delay)
                    lo, hi = reply.start, reply.start + reply.num_tokens
                    frames = [np.ascontiguousarray(d[:, :, lo:hi]) for d in data]
                    header = Blocks(PROTOCOL_VERSION, job.wire_id, reply.block_ids, reply.start,
                                    reply.num_tokens, self.fingerprint or {},
                                    sign(self.secret, "blocks", job.wire_id))
                    sock.send_multipart([_encoder.encode(header), *frames], copy=False)
                    confirm = self._await(sock, decoder, job.wire_id)
                    if isinstance(confirm, Confirm):
                        ok = True
                        with self.lock:
                            c = self.counters
                            c["splitwise_blocks_sent"] += -(-hi // self.block_size) - lo // self.block_size
                            c["splitwise_bytes_sent"] += sum(f.nbytes for f in frames)
                            c["splitwise_transfers_sent"] += 1
                    else:
                        why = confirm.reason if isinstance(confirm, Refuse) else str(confirm)
            else:
                why = reply.reason if isinstance(reply, Refuse) else str(reply)
        except Exception as e:                    # never let a transfer take the engine down
            why = f"{type(e).__name__}: {e}"
        finally:
            sock.close(linger=0)
            with self.lock:
                if ok:
                    self.counters["splitwise_transfer_seconds_sum"] += time.monotonic() - t0
                    self.transfer_times.append(time.monotonic() - t0)
                else:
                    self.counters["splitwise_transfers_failed"] += 1
                self.done_sending.add(job.request_id)     # the blocks go back either way
        if not ok:
            log.warning("splitwise: transfer of %s to %s failed: %s", job.request_id, job.peer, why)

    def _await(self, sock, decoder, rid: str):
        deadline = time.monotonic() + self.timeout
        while not self.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return f"no answer from the decode instance within {self.timeout:g} s"
            if sock.poll(min(100, int(left * 1000) + 1)):
                raw = sock.recv()
                try:
                    msg = decoder.decode(raw)
                except msgspec.DecodeError as e:
                    return f"undecodable reply ({e})"
                if msg.v != PROTOCOL_VERSION or msg.request_id != rid:
                    return f"a reply of version {msg.v} for {msg.request_id!r}"
                return msg
        return "the engine is stopping"

    # -- decode side: the socket thread ------------------------------------------------------
    def _reply(self, identity: bytes, msg) -> None:
        self.outgoing.put((identity, [_encoder.encode(msg)]))

    def _reject(self, identity: bytes | None, rid: str, why: str) -> None:
        with self.lock:
            self.counters["splitwise_messages_rejected"] += 1
            waiting = self.expected.get(rid)
            if waiting is not None and rid not in self.accepted:    # its prefill side cannot serve it
                self.failed[waiting[1]] = f"splitwise: refused: {why}"
        log.warning("splitwise: rejected a message%s: %s", f" for {rid!r}" if rid else "", why)
        if identity is not None:
            self._reply(identity, Refuse(PROTOCOL_VERSION, rid, why))

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToDecode)
        sock = self.sock
        while not self.stop.is_set():
            try:
                while True:
                    identity, frames = self.outgoing.get_nowait()
                    sock.send_multipart([identity, *frames])
            except queue.Empty:
                pass
            except zmq.ZMQError as e:
                log.warning("splitwise: cannot reply: %s", e)
            self._sweep_unknown()
            try:
                if not sock.poll(POLL_MS):
                    continue
                parts = sock.recv_multipart(copy=True)
            except zmq.ZMQError:
                if self.stop.is_set():
                    return
                continue
            try:
                self._handle(parts, decoder)
            except Exception as e:                 # a bad message must never stop the thread
                self._reject(parts[0] if parts else None, "", f"{type(e).__name__}: {e}")

    def _handle(self, parts: list[bytes], decoder) -> None:
        if len(parts) < 2:
            return self._reject(None, "", "no header frame")
        identity, header, payload = parts[0], parts[1], parts[2:]
        if len(header) > MAX_HEADER_BYTES:
            return self._reject(identity, "", f"header of {len(header)} bytes")
        try:
            msg = decoder.decode(header)
        except msgspec.DecodeError as e:
            return self._reject(identity, "", f"not a splitwise message ({e})")
        rid = msg.request_id
        if msg.v != PROTOCOL_VERSION:
            return self._reject(identity, rid, f"protocol version {msg.v}, expected {PROTOCOL_VERSION}")
        kind = "offer" if isinstance(msg, Offer) else "blocks"
        if not hmac.compare_digest(msg.auth.encode(), sign(self.secret, kind, rid).encode()):
            return self._reject(identity, rid, "wrong or missing connector secret")
        if self.fingerprint is not None and msg.fingerprint != self.fingerprint:
            diff = sorted(k for k in set(msg.fingerprint) | set(self.fingerprint)
                          if msg.fingerprint.get(k) != self.fingerprint.get(k))
            return self._reject(identity, rid, f"another model or KV layout (differs in: {', '.join(diff)})")
        if isinstance(msg, Offer):
            if payload:
                return self._reject(identity, rid, "an offer carries no payload")
            if msg.num_tokens <= 0:
                return self._reject(identity, rid, f"offer of {msg.num_tokens} tokens")
            with self.lock:
                if rid in self.offers or rid in self.accepted:
                    return self._reject(identity, rid, "a transfer for this request is already under way")
                self.offers[rid] = _OfferState(identity, msg, time.monotonic())
            return
        # Blocks
        acc = self.accepted.get(rid)
        if acc is None:
            return self._reject(identity, rid, "no reservation for this request id")
        _, block_ids, start, n, _, _ = acc
        if msg.block_ids != block_ids or msg.start != start or msg.num_tokens != n:
            return self._reject(identity, rid, "block ids or token counts differ from the reservation")
        want = 2 * self.spec.num_kv_heads * n * self.spec.head_dim * self.dtype.itemsize
        if len(payload) != self.spec.num_layers or any(len(f) != want for f in payload):
            return self._reject(identity, rid, f"payload must be {self.spec.num_layers} frames of {want} bytes")
        with self.lock:
            self.arrived[rid] = payload

    def _sweep_unknown(self) -> None:
        """Refuse offers for request ids this instance never saw (after a grace
        period: the router opens the decode request first, but it may not
        have reached the scheduler yet)."""
        now = time.monotonic()
        with self.lock:
            stale = [(rid, st) for rid, st in self.offers.items()
                     if rid not in self.expected and now - st.arrived > self.unknown_grace]
            for rid, _ in stale:
                del self.offers[rid]
        for rid, st in stale:
            self._reject(st.identity, rid, "unknown request id")


TIME_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


@hookimpl
def fdx_register_connectors(register):
    register("splitwise", SplitwiseConnector)
